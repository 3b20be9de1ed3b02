#!/usr/bin/env bash
set -uo pipefail
BEFORE=/work/wt/base; AFTER=/work/main; OUT=$AFTER/bench/results/backbone-2026-12-03; PY=$AFTER/.venv/bin/python
in_tree() { local tree=$1; shift; (cd "$tree" && PYTHONPATH=$tree:$tree/protos "$PY" "$@"); }
tag() { [ "$1" = "$BEFORE" ] && echo before || echo after; }
# decode: after's bench/decode.py makes the model (bench/kernels.py shadowed the `kernels` package transformers
# probes for, so it is bench/kernel_speed.py now); the before tree reads the same saved model
in_tree "$AFTER" bench/decode.py --no-transformers --reps 3 --batches 1,8,32 > "$OUT/decode-after-1.txt" 2>&1
mkdir -p "$BEFORE/bench/out" && cp -r "$AFTER"/bench/out/* "$BEFORE/bench/out/"
in_tree "$BEFORE" bench/decode.py --no-transformers --reps 3 --batches 1,8,32 > "$OUT/decode-before-1.txt" 2>&1
in_tree "$BEFORE" bench/decode.py --no-transformers --reps 3 --batches 1,8,32 > "$OUT/decode-before-2.txt" 2>&1
in_tree "$AFTER" bench/decode.py --no-transformers --reps 3 --batches 1,8,32 > "$OUT/decode-after-2.txt" 2>&1
# admission, the 1x cell of `both` again with more repetitions
in_tree "$AFTER" bench/admission_cpu.py --tree "$BEFORE" --tree "$AFTER" --mix both --loads 1 --seconds 10 --reps 9 \
  > "$OUT/admission_cpu-both-1x.txt" 2> "$OUT/admission_cpu-both-1x.err"
# a second round of the real-replica runs, the trees in the other order
for tree in "$AFTER" "$BEFORE"; do
  in_tree "$tree" bench/fair_share.py --capacity-qps 16.8 --duration 15 --repeats 1 --out "$OUT/fair_share-$(tag $tree)-2" \
    > "$OUT/fair_share-$(tag $tree)-2.txt" 2> "$OUT/fair_share-$(tag $tree)-2.err"
  in_tree "$tree" bench/class_priority.py --capacity-qps 16.8 --duration 15 --repeats 1 --out "$OUT/class_priority-$(tag $tree)-2" \
    > "$OUT/class_priority-$(tag $tree)-2.txt" 2> "$OUT/class_priority-$(tag $tree)-2.err"
done
uptime >> "$OUT/host.txt"
