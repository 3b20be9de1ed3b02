"""ms per batch-1 decode step, best of 3 runs of 64 tokens: python step_ms.py QUANTIZE THREADS (ab.sh's probe)."""

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import decode  # noqa: E402
from decode import PROMPT, Engine, Executor, ExecutorConfig, Request, SamplingParams, _Discard, load_checkpoint  # noqa: E402


def main() -> None:
    quantize, threads = sys.argv[1], int(sys.argv[2])
    checkpoint = load_checkpoint(decode.MODEL_DIR, "bfloat16")
    config = ExecutorConfig(max_batch=1, max_seq_len=256, num_threads=threads, quantize=quantize)
    engine = Engine(Executor(checkpoint, config), checkpoint.tokenizer, ())
    prompt = tuple(checkpoint.tokenizer.encode(PROMPT).ids)

    def run(tokens: int, name: str) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(Request(name, prompt, params, engine.clock()), _Discard())
        engine.step()  # the prompt
        t0, steps = time.perf_counter(), 0
        while engine.has_work:
            engine.step()
            steps += 1
        return (time.perf_counter() - t0) / steps * 1e3

    run(32, "warm")
    print("ms/step", quantize, min(run(64, f"r{i}") for i in range(3)))


if __name__ == "__main__":
    main()
