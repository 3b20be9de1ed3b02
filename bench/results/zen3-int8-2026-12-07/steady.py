"""Steady batch-1 decode for a profiler to attach to, the engine as bench/decode.py builds it, 128-token calls back
to back:

    python steady.py int8|int4|none SECONDS &  sleep 6; perf record -e cpu-clock -p $! -- sleep 6
"""

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import decode  # noqa: E402
from decode import PROMPT, Engine, Executor, ExecutorConfig, Request, SamplingParams, _Discard, load_checkpoint  # noqa: E402

checkpoint = load_checkpoint(decode.MODEL_DIR, "bfloat16")
config = ExecutorConfig(max_batch=1, max_seq_len=256, num_threads=2, quantize=sys.argv[1])
engine = Engine(Executor(checkpoint, config), checkpoint.tokenizer, ())
prompt = tuple(checkpoint.tokenizer.encode(PROMPT).ids)


def run(tokens: int, name: str) -> None:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(Request(name, prompt, params, engine.clock()), _Discard())
    while engine.has_work:
        engine.step()


run(32, "warm")
print("ready", flush=True)
began, calls = time.time(), 0
while time.time() - began < float(sys.argv[2]):
    run(128, f"r{calls}")
    calls += 1
print("calls", calls, file=sys.stderr)
