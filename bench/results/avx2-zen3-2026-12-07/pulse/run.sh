#!/bin/bash
# The pulse at 2x the bf16 capacity, bf16 / int8 / int4 (the vnni int path, on a real AVX2 host): the Zen 5 run's
# script, writing here.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
R=bench/results/avx2-zen3-2026-12-07/pulse exec bash bench/results/vnni-2026-12-06/pulse/run.sh
