#!/usr/bin/env bash
# Held calls that keep their promises (issue 35), 2026-12-07, Zen 3 (AMD EPYC family 25 model 1, AVX2, 2 cores).
# The virtual replica (deterministic: the same figures on any host): before = a worktree of 01e0935, after = main.
set -euo pipefail
out=bench/results/hold-edf-2026-12-07
git worktree add -q /tmp/zq-before 01e0935
py=$PWD/.venv/bin/python
(cd /tmp/zq-before && $py bench/burst_virtual.py --variants "default=;hold=hold_in_slack=True") > $out/virtual-before.md
git worktree remove /tmp/zq-before
.venv/bin/python bench/burst_virtual.py --variants "default=;hold=hold_in_slack=True" > $out/virtual.md
# a real replica of the bundled model: FIFO, the default (--no-hold) and --hold on the same seeded Poisson schedules
.venv/bin/python bench/slack.py --loads 1,2 --seeds 1,2 --duration 20 --out $out/slack > $out/slack.md 2> $out/slack.err
# bursts on the same replica, 4-s budgets: the default, then --hold (each with its own FIFO run)
for mode in default hold; do
  args=(); [ $mode = hold ] && args=(--serve-args=--hold)
  .venv/bin/python bench/board.py --capacity-qps 16.8 --loads 1,2 --arrivals burst --deadline-ms 4000 "${args[@]}" \
    --out $out/bursts/$mode > $out/bursts/$mode.md
done
