#!/bin/bash
cd "$(dirname "$0")/../../.."
# ab-round1-3.txt: rounds 1 2 3 of configs "1024 T0" (before) and "2048 T1"; ab-prefetch-distances.txt: this loop.
# Sets tile.h's prefetch distance and hint, rebuilds, measures; restores tile.h from git at the end.
set_cfg() { sed -i "s/constexpr int64_t kPrefetchBytes = [0-9]*;/constexpr int64_t kPrefetchBytes = $1;/" services/inference/device/kernels/tile.h; sed -i "s/_MM_HINT_T[0-9]);/_MM_HINT_$2);/" services/inference/device/kernels/tile.h; .venv/bin/python -m services.inference.device.kernels build >/dev/null 2>&1; }
for round in 1 2; do for cfg in "2048 T1" "4096 T1" "1024 T1"; do set_cfg $cfg; for q in none int8 int4; do echo "$cfg $q $(.venv/bin/python bench/results/prefetch-2026-12-06/step_ms.py $q 2 2>/dev/null | grep -o 'ms/step.*' | awk '{print $3}')"; done; done; done
git checkout services/inference/device/kernels/tile.h
