"""Sampling cost per engine step: zeroqueue's sampler against the same draw done with a full sort of the
vocabulary per row (what the sampler did before 2026-11-30), side by side in one run, one CPU thread.

    .venv/bin/python bench/sampling.py [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "protos")]

from services.inference.device.sampler import sample, uniform  # noqa: E402
from services.inference.sched.request import SamplingParams  # noqa: E402
from services.logs import configure_logging  # noqa: E402


def full_sort_sample(logits: torch.Tensor, params: list[SamplingParams], draw_index: list[int]) -> list[int]:
    """The baseline: every sampled row sorts its whole vocabulary, then draws by inverse CDF."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        values, ids = torch.sort(logits[row] / p.temperature, descending=True)
        probs = torch.softmax(values, dim=-1)
        if p.top_p < 1.0:
            keep = int(((torch.cumsum(probs, dim=-1) - probs) < p.top_p).sum())
            probs, ids = probs[:keep], ids[:keep]
        cdf = torch.cumsum(probs, dim=-1)
        target = torch.tensor([uniform(p.seed, draw_index[row]) * float(cdf[-1])])
        tokens[row] = int(ids[min(int(torch.searchsorted(cdf, target, right=True)), len(ids) - 1)])
    return tokens


def time_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    modes = {
        "temperature 0.8": SamplingParams(temperature=0.8, seed=1),
        "temperature 0.8, top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    }
    rows = []
    for batch, vocab in ((8, 4096), (32, 4096), (8, 49152), (32, 49152)):
        # logits with a spread like a trained model's (std 4): peaked, the nucleus within a few hundred tokens
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 4.0
        for mode, p in modes.items():
            params, index = [p] * batch, list(range(batch))
            ours = time_ms(lambda: sample(logits, params, index), args.reps)
            base = time_ms(lambda: full_sort_sample(logits, params, index), args.reps)
            rows.append(
                {
                    "batch": batch,
                    "vocab": vocab,
                    "mode": mode,
                    "full_sort_ms": round(base, 2),
                    "zeroqueue_ms": round(ours, 2),
                    "speedup": round(base / ours, 1),
                }
            )
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    configure_logging()  # every line on stderr: stdout is the bench's report
    main()
