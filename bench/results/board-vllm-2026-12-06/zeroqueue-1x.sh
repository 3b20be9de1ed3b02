#!/bin/bash
# run from each tree in turn (main at 115f68b as "after", a worktree of 3cacda6 as "before"), seeds 1-3 alternating, 2026-12-06 22:13-22:21 UTC, Zen 4
# 1x through the HTTP door, zeroqueue only, from the tree in cwd: NAME SEED
name=$1; seed=$2
.venv/bin/python bench/http_pulse.py --capacity-json /work/main/bench/results/board-vllm-2026-12-05/capacity-closed-loop.json --model /work/main/bench/out/smollm2-135m-random --context 2048 --loads 1 --seed $seed --duration 20 --engines zeroqueue --out /tmp/onex-$name-$seed > /dev/null 2> /tmp/onex-$name-$seed.err
echo "$name seed $seed: $(grep goodput /tmp/onex-$name-$seed.err | sed 's/.*goodput/goodput/')"
