#!/bin/bash
# before (the parent of the change, in a worktree) and after (this tree), alternating, 5 runs each, twice
set -u
cd /work/main
D=bench/results/lateness-2026-12-07
git worktree add -q /tmp/before-lateness 47e2005  # the parent of c0a4896 2>/dev/null || true
cp -r services/inference/device/kernels/_build /tmp/before-lateness/services/inference/device/kernels/  # same sources
for round in 1 2; do
  for tree in before after; do
    dir=/work/main; [ $tree = before ] && dir=/tmp/before-lateness
    # the harness logs to stdout beside the results: keep the result lines (a log line may end without a newline)
    (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python /work/main/$D/bursts_ab.py 5) 2>/dev/null \
      | grep -o "run [0-9]*: first [0-9]* second [0-9]* lateness [0-9./ ]*" > $D/$tree-$round.txt
  done
done
git worktree remove --force /tmp/before-lateness

# then (aedd84a), the unretried burst from a process of its own, this tree only, 8 runs
(PYTHONPATH=/work/main .venv/bin/python $D/bursts_ab.py 8 --elsewhere) 2>/dev/null \
  | grep -o "run [0-9]*: first [0-9]* second [0-9]* lateness [0-9./ ]*" > $D/elsewhere.txt
