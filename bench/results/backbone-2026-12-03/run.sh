#!/usr/bin/env bash
# Issue 30 before/after, side by side on one host: BEFORE is a worktree of d568266 (main before the issue),
# AFTER this checkout. Each tree runs from its own directory with its own tree first on sys.path; both share the
# venv and the compiled kernels (their sources are byte for byte the same). Raw output lands beside this script.
set -uo pipefail
BEFORE=${BEFORE:-/work/wt/base}
AFTER=$(cd "$(dirname "$0")/../../.." && pwd)
OUT=$AFTER/bench/results/backbone-2026-12-03
PY=$AFTER/.venv/bin/python
in_tree() { local tree=$1; shift; (cd "$tree" && PYTHONPATH=$tree:$tree/protos "$PY" "$@"); }
tag() { [ "$1" = "$BEFORE" ] && echo before || echo after; }
lscpu | grep -E "Model name|Flags" | sed 's/Flags:.*\(avx512f\|avx2\).*/& /' | cut -c1-400 > "$OUT/host.txt"
uptime >> "$OUT/host.txt"
# 1. what a decision costs, interleaved in one process (decisions are identical in both trees)
for mix in one both; do
  in_tree "$AFTER" bench/admission_cpu.py --tree "$BEFORE" --tree "$AFTER" --mix $mix --seconds 10 --reps 5 \
    > "$OUT/admission_cpu-$mix.txt" 2> "$OUT/admission_cpu-$mix.err"
done
# 2. decode, the trees alternating, two pairs
for rep in 1 2; do for tree in "$BEFORE" "$AFTER"; do
  in_tree "$tree" bench/decode.py --no-transformers --reps 3 --batches 1,8,32 > "$OUT/decode-$(tag $tree)-$rep.txt" 2>&1
done; done
# 3. fair share and class priority on real replicas, one seeded round each, capacity as measured on this model
for tree in "$BEFORE" "$AFTER"; do
  in_tree "$tree" bench/fair_share.py --capacity-qps 16.8 --duration 15 --repeats 1 --out "$OUT/fair_share-$(tag $tree)" \
    > "$OUT/fair_share-$(tag $tree).txt" 2> "$OUT/fair_share-$(tag $tree).err"
  in_tree "$tree" bench/class_priority.py --capacity-qps 16.8 --duration 15 --repeats 1 --out "$OUT/class_priority-$(tag $tree)" \
    > "$OUT/class_priority-$(tag $tree).txt" 2> "$OUT/class_priority-$(tag $tree).err"
done
# 4. the pulse matrix (capacity, then deadline vs fifo at 0.5x-4x), short runs
for tree in "$BEFORE" "$AFTER"; do
  in_tree "$tree" bench/pulse_matrix.py --duration 10 --probe-duration 10 --capacity-duration 10 \
    --serve-args "--pace-tokens 64" --out "$OUT/pulse-$(tag $tree)" > "$OUT/pulse-$(tag $tree).txt" 2> "$OUT/pulse-$(tag $tree).err"
done
uptime >> "$OUT/host.txt"
