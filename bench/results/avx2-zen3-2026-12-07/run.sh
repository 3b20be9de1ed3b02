#!/bin/bash
# Issue 34 on a real AVX2 host (Zen 3, no AVX-512): our bf16 / int8 / int4 against llama.cpp bf16 / Q8_0 / Q4_0 and
# vLLM's CPU build, twice (peers-1, peers-2); then the linears alone, a step's profile, and the prefetch distance.
# Once: ../shared/peers/llama_cpp.sh install; llama_cpp.sh gguf bench/out/smollm2-135m-random; vllm_cpu.sh install.
set -euo pipefail
cd "$(dirname "$0")/../../.."
R=bench/results/avx2-zen3-2026-12-07
bash bench/quant_peers.sh $R/peers-1
bash bench/quant_peers.sh $R/peers-2
.venv/bin/python bench/quant_linear.py --reps 5 --rows 1,32 > $R/quant-linear.md
for q in int8 int4 none; do .venv/bin/python $R/profile/profile_step.py $q | head -8; done > $R/profile/profile.txt
bash $R/prefetch-distances.sh > $R/prefetch-distances.txt
