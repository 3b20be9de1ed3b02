#!/usr/bin/env bash
PY=/work/main/.venv/bin/python
for round in 1 2; do for tree in /work/wt/base /work/main; do
  tag=$([ $tree = /work/main ] && echo after || echo before)
  for adm in fifo deadline; do
    (cd $tree && PYTHONPATH=$tree:$tree/protos $PY -m services.cli pulse --admission $adm --serve-args "--pace-tokens 64" \
      --qps 67.2 --duration 15 --shape fixed --prompt-tokens 64 --max-tokens 256 --deadline-ms 4000 --seed $round \
      --no-progress --out /tmp/ab/$tag-$adm-$round > /tmp/ab/$tag-$adm-$round.txt 2>/tmp/ab/$tag-$adm-$round.err)
  done
done; done
