# The AVX2 build's int8 rows of x in 7 bits (x-in-7-bits.patch), against main, on an AVX2 host; run from main.
# /tmp/A: a worktree of main; /tmp/B: the same with the patch applied. quant_linear alternates between them.
set -e
MAIN=$PWD
git worktree add -f /tmp/A HEAD
git worktree add -f /tmp/B HEAD && (cd /tmp/B && git apply "$MAIN/bench/results/x7-avx2-2026-12-07/x-in-7-bits.patch")
for T in 1 2; do
  for r in 1 2; do
    for t in /tmp/A /tmp/B; do
      echo "== $t round $r $(date -u +%H:%M:%S)"
      (cd $t && OMP_NUM_THREADS=$T "$MAIN/.venv/bin/python" bench/quant_linear.py --reps 5 --rows 1,8,32 2>/dev/null)
    done
  done > "bench/results/x7-avx2-2026-12-07/quant-linear-$T-thread.txt"
done
(cd /tmp/B && "$MAIN/.venv/bin/python" bench/quant_quality.py --groups 64) > bench/results/x7-avx2-2026-12-07/quality-x7.md
(cd /tmp/B && "$MAIN/.venv/bin/python" -m pytest -q -s tests/inference/test_int8_weights.py -k logits_equal) | grep MEASURE
