#!/bin/bash
# The pulse at 2x the bf16 capacity, bf16 / int8 / int4 (the vnni int path), one replica at a time, the same schedule.
# From the repository root; R=DIR writes elsewhere (bench/results/avx2-zen3-2026-12-07/pulse/run.sh).
set -euo pipefail
R=${R:-bench/results/vnni-2026-12-06/pulse} M=bench/out/smollm2-135m-random
.venv/bin/zeroqueue pulse --capacity --model $M --duration 15 --no-plots --out $R/capacity > $R/capacity.txt
qps=$(python3 -c "import json,sys; print(round(2 * json.load(open('$R/capacity/capacity.json'))['capacity_qps'], 2))")
for round in 1 2; do
  for q in none int8 int4; do
    .venv/bin/zeroqueue pulse --model $M --qps "$qps" --duration 30 --seed $((6 + round)) --no-plots \
      --serve-args "--quantize $q" --out $R/round$round-$q > $R/round$round-$q.txt
  done
done
