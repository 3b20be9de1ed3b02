#!/bin/bash
# poisson 2x on the SmolLM2 shape, deadline replica only, seeds 1 and 2, alternating trees
for seed in 1 2; do
  for tree in /work/main; do
    name=$(basename $tree)
    out=/tmp/ab2/$name-seed$seed
    rm -rf $out
    (cd $tree && .venv/bin/python -m services.cli pulse --admission deadline --serve-args= --qps 11.400 --shape fixed --prompt-tokens 64 --max-tokens 32 --deadline-ms 2000.0 --arrival poisson --model /work/main/bench/out/smollm2-135m-random --duration 20 --seed $seed --out $out --no-plots --no-progress > /dev/null 2>&1)
    grep request_done $out/replica-deadline/replica.log | python3 -c "
import sys, json, collections
rows = [json.loads(l[l.index('{'):]) for l in sys.stdin]
c = collections.Counter(r['outcome'] for r in rows)
print('$name seed $seed', len(rows), dict(c))"
  done
done
