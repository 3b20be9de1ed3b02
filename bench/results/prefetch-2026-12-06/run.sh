#!/bin/bash
# Prefetching 2 KiB ahead into L2 (this tree) against 1 KiB into L1 (a worktree of 7126131 at /tmp/wt-base), decode
# tok/s, alternating trees, the AVX-512 build twice each, then the AVX2 build once each.
set -euo pipefail
R=$PWD/bench/results/prefetch-2026-12-06 PY=$PWD/.venv/bin/python
run() {  # tree, name, env...
  local tree=$1 name=$2; shift 2
  date -u +%H:%M:%S >&2
  (cd "$tree" && env "$@" "$PY" bench/decode.py --int8 --int4 --no-transformers --reps 3 > "$R/$name.txt")
}
for round in 1 2; do
  run /tmp/wt-base before-avx512-$round ZQ_X=1
  run "$PWD" after-avx512-$round ZQ_X=1
done
run /tmp/wt-base before-avx2 ZQ_KERNELS_ISA=avx2
run "$PWD" after-avx2 ZQ_KERNELS_ISA=avx2
echo done >&2
