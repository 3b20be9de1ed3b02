"""What the prefix cache saves: calls that share a long prompt prefix (a system prompt, a document asked several
questions), served by the engine with the cache on and off, interleaved round by round in one run.

Each call is the shared prefix plus a question of its own, then NEW_TOKENS greedy tokens. The first call of a
cache-on round computes the prefix (a miss, as a cold cache gives); the others hit it. Reported per mode: the time
to the first token (prefill) and to the last, the device time the engine measured for the calls (core·µs, what the
meter bills), prompt tokens the cache served, and whether the tokens equal the cache-off run's (they must).

    python bench/prefix_cache.py                       # the SmolLM2-135M shape (bench/decode.py's model)
    python bench/prefix_cache.py --model bundled       # the bundled model
    python bench/prefix_cache.py --prefix-tokens 896 --batch 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "bench")]

from board import host  # noqa: E402  (bench/board.py: the CPU, its family and model, its flags)
from decode import make_model  # noqa: E402  (bench/decode.py: the SmolLM2-135M-shaped random model)

from services.inference.bundled_model import BUNDLED_MODEL  # noqa: E402
from services.inference.device.executor import Executor, ExecutorConfig  # noqa: E402
from services.inference.device.loader import load_checkpoint  # noqa: E402
from services.inference.engine.engine import Engine  # noqa: E402
from services.inference.sched.request import Request, SamplingParams  # noqa: E402
from services.logs import configure_logging  # noqa: E402

NEW_TOKENS = 16
SALT = b"tenant:bench"


class Times:
    """An output sink that keeps each call's first and last token times and its tokens."""

    def __init__(self) -> None:
        self.first_ns: dict[str, int] = {}
        self.last_ns: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}

    def put(self, output) -> None:
        self.first_ns.setdefault(output.call_id, output.time_ns)
        self.last_ns[output.call_id] = output.time_ns
        self.tokens.setdefault(output.call_id, []).extend(output.token_ids)


class DeviceTime:
    """A step observer: the engine's measured step time, in core·µs, summed."""

    def __init__(self, num_units: int) -> None:
        self.num_units, self.unit_us = num_units, 0

    def on_step(self, digest) -> None:
        if digest.ran:
            self.unit_us += digest.interval_ns // 1000 * self.num_units

    def on_idle(self, now_ns: int) -> None:
        pass


def prompts(tokenizer, prefix_tokens: int, calls: int) -> list[tuple[int, ...]]:
    text = "".join(f"def handler_{i}(event, context):\n    return process(event['body'], {i})\n" for i in range(400))
    prefix = tokenizer.encode(text).ids[:prefix_tokens]
    assert len(prefix) == prefix_tokens, "the prefix text is too short for --prefix-tokens"
    return [
        tuple(prefix + tokenizer.encode(f"\n# question {i}: what does handler_{i} return?\n").ids) for i in range(calls)
    ]


def run_round(engine: Engine, device: DeviceTime, calls: list[tuple[int, ...]], salt, batch: int, tag: str) -> dict:
    """Serves the calls `batch` at a time; the first call runs alone first (it fills the cache when on)."""
    sink, before_us = Times(), device.unit_us
    groups = [calls[:1]] + [calls[i : i + batch] for i in range(1, len(calls), batch)]
    requests = []
    for g, group in enumerate(groups):
        for i, prompt in enumerate(group):
            sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
            requests.append(Request(f"{tag}-{g}-{i}", prompt, sampling, engine.clock(), cache_salt=salt))
            engine.add_request(requests[-1], sink)
        start_ns = engine.clock()
        starts = {r.call_id: start_ns for r in requests[-len(group) :]}
        while engine.has_work:
            engine.step()
        for call_id, t0 in starts.items():
            sink.first_ns[call_id] -= t0
            sink.last_ns[call_id] -= t0
    later = [r.call_id for r in requests[1:]]  # the calls after the first: hits when the cache is on
    return {
        "ttft_ms": statistics.median(sink.first_ns[c] for c in later) / 1e6,
        "e2e_ms": statistics.median(sink.last_ns[c] for c in later) / 1e6,
        "first_call_ttft_ms": sink.first_ns[requests[0].call_id] / 1e6,
        "core_us": device.unit_us - before_us,
        "cached_prompt_tokens": sum(r.num_cached_tokens for r in requests),
        "prompt_tokens": sum(r.num_prompt_tokens for r in requests),
        "tokens": [sink.tokens[r.call_id] for r in requests],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "bundled"], default="smollm2")
    ap.add_argument("--prefix-tokens", type=int, default=448)
    ap.add_argument("--calls", type=int, default=9, help="calls per round: the first fills the cache")
    ap.add_argument("--batch", type=int, default=1, help="calls after the first that run together")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = ap.parse_args()
    configure_logging(json_logs=False)
    path, dtype = (make_model(), "bfloat16") if args.model == "smollm2" else (BUNDLED_MODEL, "auto")
    checkpoint = load_checkpoint(path, dtype)
    max_seq_len = min(1024, checkpoint.args.max_position_embeddings)
    executor = Executor(checkpoint, ExecutorConfig(max_batch=max(args.batch, 1), max_seq_len=max_seq_len))
    device = DeviceTime(executor.info.num_units)
    engine = Engine(executor, checkpoint.tokenizer, (), observers=[device])
    calls = prompts(checkpoint.tokenizer, args.prefix_tokens, args.calls)
    run_round(engine, device, calls[:2], None, 1, "warm")
    rounds: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(args.rounds):  # interleaved, so drift in the host's speed hits both modes alike
        for mode, salt in (("off", None), ("on", SALT)):
            engine.scheduler.blocks.reset()  # every cache-on round starts cold: its first call is a miss
            rounds[mode].append(run_round(engine, device, calls, salt, args.batch, f"{mode}{r}"))
    same = all(a["tokens"] == b["tokens"] for a, b in zip(rounds["off"], rounds["on"]))
    result = {
        "host": host(),
        "model": args.model,
        "prefix_tokens": args.prefix_tokens,
        "calls": args.calls,
        "batch": args.batch,
        "block_size": executor.block_size,
        "tokens_identical": same,
    }
    for mode, runs in rounds.items():
        result[mode] = {
            key: statistics.median(run[key] for run in runs)
            for key in ("ttft_ms", "e2e_ms", "first_call_ttft_ms", "core_us", "cached_prompt_tokens", "prompt_tokens")
        }
    off, on = result["off"], result["on"]
    result["ratio_off_over_on"] = {k: round(off[k] / on[k], 2) for k in ("ttft_ms", "e2e_ms", "core_us")}
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
