#!/usr/bin/env bash
PY=/work/main/.venv/bin/python
for round in 1 2; do for c in head baced08 1a71792; do
  tree=/work/wt/b-$c; out=/tmp/ab/bis2-$c-$round; rm -rf $out
  (cd $tree && PYTHONPATH=$tree:$tree/protos $PY -m services.cli pulse --admission fifo --serve-args "--pace-tokens 64" \
    --qps 67.2 --duration 15 --shape fixed --prompt-tokens 64 --max-tokens 256 --deadline-ms 4000 --seed 1 \
    --no-progress --out $out > $out.txt 2>&1)
  echo "$c $round $(grep -E 'requests sent|goodput, req/s' $out.txt | tr -s ' ' | tr '\n' ' ')"
done; done
