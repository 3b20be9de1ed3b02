"""What structured output and log-probabilities cost decode, side by side in one run (issue 31's goal: at batch 32,
at most 5 % with every row constrained and 2 % with a quarter of them).

Our engine decodes greedily at batch 1, 8 and 32 with, in turn: no row constrained; a quarter of the rows under a
JSON Schema; every row under it; every row reporting 20 log-probabilities. The schema (a list of at least 40
objects of a string and an integer) cannot be finished early, so every row stays in the batch and walks through
strings, numbers and structure. Each run's decode steps with the whole batch are timed, and inside each the host's
draw (the executor's `_sample`: masks, argmax, log-probabilities, the matchers' advance), which is all the
configurations change: its growth over the plain draw, as a share of the plain step, is the overhead measured
directly, without the step's own jitter on a shared host. The configurations are interleaved (A B C D, D C B A,
...) so that drift falls on all of them; medians are reported.

Two models: the bundled one (vocabulary 4,096) and the SmolLM2-135M shape (bench/decode.py's random weights) with a
byte-level BPE of 49,152 tokens trained on the standard library (bench/grammar_cases.py's), so that the mask
is as wide as a real model's.

    python bench/structured_overhead.py --out bench/results/structured-overhead-2026-12-04.json
    python bench/structured_overhead.py --models bundled --reps 2      # quicker
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "bench")]

from decode import make_model  # noqa: E402  (bench/decode.py)
from grammar_cases import trained_tokenizer  # noqa: E402  (bench/grammar_cases.py)

from services.inference.bundled_model import BUNDLED_MODEL  # noqa: E402
from services.inference.device.executor import Executor, ExecutorConfig  # noqa: E402
from services.inference.device.loader import load_checkpoint  # noqa: E402
from services.inference.engine.engine import Engine  # noqa: E402
from services.inference.grammar import ConstraintKind, GrammarLimits, make_constraint  # noqa: E402
from services.inference.sched.request import Request, SamplingParams  # noqa: E402
from services.logs import configure_logging  # noqa: E402

SCHEMA = json.dumps(
    {
        "type": "array",
        "minItems": 40,
        "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "qty": {"type": "integer"}},
            "required": ["name", "qty"],
            "additionalProperties": False,
        },
    }
)
CONFIGS = ("plain", "quarter constrained", "all constrained", "all logprobs")
NEW_TOKENS = 64
PROMPT = "def inventory():\n    return "


class _Discard:
    def put(self, output) -> None:
        pass


def model_dirs(names: list[str]) -> dict[str, Path]:
    dirs = {}
    if "bundled" in names:
        dirs["bundled (vocab 4k)"] = BUNDLED_MODEL
    if "smollm2" in names:
        target = ROOT / "bench/out/smollm2-135m-bpe49k"
        if not (target / "model.safetensors").exists():
            source = make_model()
            target.mkdir(parents=True, exist_ok=True)
            for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
                shutil.copy(source / name, target / name)
            trained_tokenizer().save(str(target / "tokenizer.json"))
        dirs["SmolLM2-135M shape (vocab 49k)"] = target
    return dirs


def sampling(config: str, row: int, batch: int, constraint) -> SamplingParams:
    masked = config == "all constrained" or (config == "quarter constrained" and row < max(batch // 4, 1))
    return SamplingParams(
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        constraint=constraint if masked else None,
        logprobs=config == "all logprobs",
        top_logprobs=20 if config == "all logprobs" else 0,
    )


class DrawTimer:
    """Wraps the executor's `_sample` (the host's draw of a step) and keeps the last one's ms."""

    def __init__(self, executor: Executor) -> None:
        self.last_ms = 0.0
        self._sample = executor._sample
        executor._sample = self

    def __call__(self, step, logits):
        t0 = time.perf_counter_ns()
        try:
            return self._sample(step, logits)
        finally:
            self.last_ms = (time.perf_counter_ns() - t0) / 1e6


def step_ms(
    engine: Engine, timer: DrawTimer, config: str, batch: int, constraint, prompt: tuple[int, ...], tag: str
) -> tuple[float, float]:
    """Median ms of the decode steps that ran the whole batch, and of their host draws, for one run of `config`."""
    for i in range(batch):
        engine.add_request(
            Request(f"{tag}-{i}", prompt, sampling(config, i, batch, constraint), engine.clock()), _Discard()
        )
    times, draws = [], []
    while engine.has_work:
        report = engine.step()
        if report is not None and not report.scheduled.prefills and len(report.scheduled.decodes) == batch:
            times.append(report.interval_ns / 1e6)
            draws.append(timer.last_ms)
    return statistics.median(times), statistics.median(draws)


def measure(path: Path, batches: list[int], reps: int) -> dict:
    checkpoint = load_checkpoint(path, "bfloat16")
    executor = Executor(checkpoint, ExecutorConfig(max_batch=max(batches), max_seq_len=256, num_threads=1))
    engine = Engine(executor, checkpoint.tokenizer, ())
    timer = DrawTimer(executor)
    constraint = make_constraint(ConstraintKind.JSON_SCHEMA, SCHEMA, GrammarLimits())
    prompt = tuple(checkpoint.tokenizer.encode(PROMPT).ids)
    step_ms(engine, timer, "all constrained", 2, constraint, prompt, "warm")  # compiles the grammar, warms up
    out = {}
    for batch in batches:
        runs: dict[str, list[tuple[float, float]]] = {c: [] for c in CONFIGS}
        for r in range(reps):
            order = CONFIGS if r % 2 == 0 else tuple(reversed(CONFIGS))
            for config in order:
                tag = f"{batch}-{r}-{config}"
                runs[config].append(step_ms(engine, timer, config, batch, constraint, prompt, tag))
        plain_step = statistics.median(s for s, _ in runs["plain"])
        plain_draw = statistics.median(d for _, d in runs["plain"])
        out[batch] = {}
        for c, v in runs.items():
            step, draw = statistics.median(s for s, _ in v), statistics.median(d for _, d in v)
            out[batch][c] = {
                "step_ms": round(step, 3),
                "draw_ms": round(draw, 3),
                "tok_s": round(batch / step * 1000, 1),
                "step_overhead_pct": round((step / plain_step - 1) * 100, 1),
                "draw_overhead_pct": round((draw - plain_draw) / plain_step * 100, 1),
                "runs_ms": [[round(s, 3), round(d, 3)] for s, d in v],
            }
    engine.grammars.close()
    return out


def table(results: dict) -> str:
    """Per configuration: tok/s, the host draw's ms a step, and (beside plain) the overhead as the draw's growth
    over plain's in % of the plain step, then the whole step's growth (jittery on a shared host)."""
    lines = ["| model | batch | " + " | ".join(CONFIGS) + " |", "|---|---|" + "---|" * len(CONFIGS)]
    for model, by_batch in results.items():
        for batch, row in by_batch.items():
            cells = []
            for c in CONFIGS:
                r = row[c]
                cell = f"{r['tok_s']} tok/s, draw {r['draw_ms']} ms"
                if c != "plain":
                    cell += f": {r['draw_overhead_pct']:+.1f} % (step {r['step_overhead_pct']:+.1f} %)"
                cells.append(cell)
            lines.append(f"| {model} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bundled,smollm2")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    configure_logging()  # every line on stderr: stdout is the bench's table
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    results = {name: measure(path, batches, args.reps) for name, path in model_dirs(args.models.split(",")).items()}
    print(table(results))
    if args.out is not None:
        host = {"platform": platform.platform(), "cpu": platform.processor(), "torch": torch.__version__}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"host": host, "date": time.strftime("%Y-%m-%d"), "results": results}, indent=1))


if __name__ == "__main__":
    main()
