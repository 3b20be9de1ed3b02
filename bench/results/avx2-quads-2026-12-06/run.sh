#!/bin/bash
# Zen 4, 2026-12-06 afternoon: the vnni int path on both builds against converting, kernels then end to end, then
# every peer in one run (bench/quant_peers.sh). One thing at a time on this host's 2 cores.
set -euo pipefail
R=bench/results/avx2-quads-2026-12-06
date -u +%H:%M >&2
ZQ_KERNELS_ISA=avx2 .venv/bin/python bench/quant_linear.py --reps 5 --rows 1,8,32,128 > $R/quant-linear-avx2.md
date -u +%H:%M >&2
.venv/bin/python bench/quant_linear.py --reps 5 --rows 1,8,32,128 > $R/quant-linear-avx512.md
date -u +%H:%M >&2
ZQ_KERNELS_ISA=avx2 .venv/bin/python bench/decode.py --int8 --int4 --no-transformers --reps 3 > $R/decode-avx2-vnni.txt
date -u +%H:%M >&2
ZQ_KERNELS_ISA=avx2 ZQ_LINEAR_INT=convert .venv/bin/python bench/decode.py --int8 --int4 --no-transformers --reps 3 > $R/decode-avx2-convert.txt
date -u +%H:%M >&2
bash bench/quant_peers.sh $R/peers
date -u +%H:%M >&2
echo done >&2
