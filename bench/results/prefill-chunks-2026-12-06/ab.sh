#!/bin/bash
# Cold prompts alone and in pairs, predicted against actual (bench/prefill_prediction.py), on the tree before the
# change (a849d8e, a worktree at /tmp/before sharing .venv, bench/out and the kernels' _build) and after, alternating.
out=$(cd "$(dirname "$0")" && pwd)
for round in 1 2; do
  for tree in /tmp/before /work/main; do
    name=$(basename $tree)
    (cd $tree && .venv/bin/python bench/prefill_prediction.py --lengths 256,1000,1900 --rounds 2 --seed $round \
      --out /tmp/pp-$name-$round > $out/prediction-$name-$round.json 2> /tmp/pp-$name-$round.err)
  done
done
