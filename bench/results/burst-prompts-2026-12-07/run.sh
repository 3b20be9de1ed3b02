#!/usr/bin/env bash
# The bundled model's replica, bursts and Poisson at 0.7x and 1x of its closed-loop capacity, each beside FIFO on the
# same seeded schedule: the default (a burst's prompts admitted behind those ahead) against --no-hold-prompts (the
# default before), one seed after another, nothing else running. Usage: bash run.sh OUT_DIR "1 2 3"
# (2026-12-07: seeds 1 and 2 in one go, then seed 1's default again, since a test run had shared the cores with
# its first pass (seed1-default-contaminated.md), then seed 3.)
set -euo pipefail
out=${1:?out dir}
seeds=${2:-"1 2 3"}
cd "$(dirname "$0")/../../.."
py=.venv/bin/python
[ -f "$out/capacity.qps" ] || {
  nice -n 5 $py bench/board.py --loads 1 --arrivals poisson --duration 5 --skip poisson@1 --out "$out/capacity-run" >/dev/null
  $py -c "import json,sys; print(json.load(open(sys.argv[1]))['saturation_qps'])" "$out/capacity-run/capacity/capacity.json" > "$out/capacity.qps"
}
qps=$(cat "$out/capacity.qps")
for seed in $seeds; do
  for flags in "" "--no-hold-prompts"; do
    name=seed$seed-${flags#--}
    name=${name%-}
    [ -n "$flags" ] || name=seed$seed-default
    nice -n 5 $py bench/board.py --capacity-qps "$qps" --loads 0.7,1 --arrivals burst,poisson --duration 20 \
      --seed "$seed" --serve-args="$flags" --out "$out/$name" > "$out/$name.md" 2> "$out/$name.err"
  done
done
