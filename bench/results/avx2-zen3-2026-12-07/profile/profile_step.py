"""Where a batch-1 decode step's time goes: torch.profiler over 32 steps, self CPU time by op."""

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import decode  # noqa: E402
import torch  # noqa: E402
from decode import PROMPT, Engine, Executor, ExecutorConfig, Request, SamplingParams, _Discard, load_checkpoint  # noqa: E402

quantize = sys.argv[1]
checkpoint = load_checkpoint(decode.MODEL_DIR, "bfloat16")
config = ExecutorConfig(max_batch=1, max_seq_len=256, num_threads=2, quantize=quantize)
engine = Engine(Executor(checkpoint, config), checkpoint.tokenizer, ())
prompt = tuple(checkpoint.tokenizer.encode(PROMPT).ids)


def run(tokens, name, prof=None):
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(Request(name, prompt, params, engine.clock()), _Discard())
    engine.step()
    t0, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    return (time.perf_counter() - t0) / steps * 1e3, steps


run(32, "warm")
print("ms/step", quantize, min(run(33, f"r{i}")[0] for i in range(3)))
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
    ms, steps = run(33, "prof")
print("profiled ms/step", ms, "steps", steps)
rows = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)
total = sum(e.self_cpu_time_total for e in rows)
print(f"total self us/step {total / steps:.0f}")
for e in rows[:25]:
    print(f"{e.key[:50]:<50} calls/step {e.count / steps:6.1f}  self us/step {e.self_cpu_time_total / steps:8.1f}")
