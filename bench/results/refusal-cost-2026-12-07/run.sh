#!/bin/bash
# issue 35's refusal cost on this host: the bare grpc.aio floor and main, interleaved, twice (Zen 5)
cd /work/main
D=bench/results/refusal-cost-2026-12-07
for i in 1 2; do
  .venv/bin/python bench/refusal_cost.py --floor --rounds 2 > $D/floor-$i.json 2> /dev/null
  .venv/bin/python bench/refusal_cost.py --rounds 2 > $D/main-$i.json 2> /dev/null
done
