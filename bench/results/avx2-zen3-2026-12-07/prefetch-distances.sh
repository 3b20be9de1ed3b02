#!/bin/bash
# Zen 3 prefetch distance A/B: ms per batch-1 step (step_ms.py, best of 3), config order rotated per round
cd "$(dirname "$0")/../../.."
set_cfg() { sed -i "s/constexpr int64_t kPrefetchBytes = [0-9]*;/constexpr int64_t kPrefetchBytes = $1;/" services/inference/device/kernels/tile.h; sed -i "s/_MM_HINT_T[0-9]);/_MM_HINT_$2);/" services/inference/device/kernels/tile.h; .venv/bin/python -m services.inference.device.kernels build >/dev/null 2>&1; }
for round in 1 2; do for cfg in "2048 T1" "4096 T1" "1024 T0" "8192 T1"; do set_cfg $cfg; for q in none int8 int4; do echo "round $round $cfg $q $(.venv/bin/python bench/results/prefetch-2026-12-06/step_ms.py $q 2 2>/dev/null | grep -o 'ms/step.*' | awk '{print $3}')"; done; done; done
git checkout services/inference/device/kernels/tile.h
.venv/bin/python -m services.inference.device.kernels build >/dev/null 2>&1
echo done
