"""Calibrates the cost model at warm-up by running synthetic steps through the real engine path."""

from __future__ import annotations

import itertools
import random
import statistics

import structlog

from ..cost.model import CostModel, fit_context_cost
from ..sched.request import Request, SamplingParams
from .engine import Engine, RequestOutput

log = structlog.get_logger(__name__)


class _Discard:
    def put(self, output: RequestOutput) -> None:
        pass


def _decode_step_us(engine: Engine, batch: int, prompt_len: int, num_steps: int, rng: random.Random) -> float:
    """Median interval of decode-only steps with `batch` requests whose context is about `prompt_len`."""
    vocab = engine.executor.model.args.vocab_size
    # the first requests decode while later prompts are still filled in chunks: outlast that
    prefill_steps = -(-batch * prompt_len // engine.scheduler.config.max_num_batched_tokens)
    for i in range(batch):
        prompt = tuple(rng.randrange(vocab) for _ in range(prompt_len))
        request = Request(
            f"calibrate-{batch}-{prompt_len}-{i}",
            prompt,
            SamplingParams(max_tokens=prefill_steps + num_steps + 1, temperature=0.0, ignore_eos=True),
            engine.clock(),
        )
        engine.add_request(request, _Discard())
    times = []
    while engine.has_work:
        report = engine.step()
        if report is not None and not report.scheduled.prefills and len(report.scheduled.decodes) == batch:
            times.append(report.interval_ns / 1000)
    return statistics.median(times)


def _prefill_step_us(engine: Engine, num_tokens: int, repeats: int, rng: random.Random) -> float:
    vocab = engine.executor.model.args.vocab_size
    times = []
    for r in range(repeats):
        prompt = tuple(rng.randrange(vocab) for _ in range(num_tokens))
        engine.add_request(
            Request(
                f"calibrate-prefill-{num_tokens}-{r}",
                prompt,
                SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                engine.clock(),
            ),
            _Discard(),
        )
        report = engine.step()
        times.append(report.interval_ns / 1000)
        while engine.has_work:
            engine.step()
    return statistics.median(times)


def calibrate(engine: Engine, num_steps: int = 6, repeats: int = 3, seed: int = 0) -> CostModel:
    """Measures T(rows) at batch sizes up to the slot count (decode steps) and beyond it up to the
    step token budget (prompt chunks), then the cost per cached position from a long-context run."""
    rng = random.Random(seed)
    slots = engine.executor.num_slots
    budget = engine.scheduler.config.max_num_batched_tokens
    _decode_step_us(engine, 1, 4, 2, rng)  # first steps pay one-time costs; keep them out
    rows, row_us = [], []
    max_prompt = engine.executor.max_seq_len - 1
    for n in sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, slots, budget}):
        if n <= slots:
            rows.append(n)
            row_us.append(_decode_step_us(engine, n, 4, num_steps, rng))
        elif n <= min(budget, max_prompt):
            rows.append(n)
            row_us.append(_prefill_step_us(engine, n, repeats, rng))
    batch = min(8, slots)
    long_ctx = min(engine.executor.max_seq_len // 2, 512)
    short_us = row_us[rows.index(batch)] if batch in rows else _decode_step_us(engine, batch, 4, num_steps, rng)
    long_us = _decode_step_us(engine, batch, long_ctx, num_steps, rng)
    per_ctx = fit_context_cost(batch * 4, short_us, batch * long_ctx, long_us)
    # a bigger step never takes less time; noise must not make the curve dip
    model = CostModel(rows=rows, row_us=list(itertools.accumulate(row_us, max)), us_per_context_token=per_ctx)
    log.info("cost_model_calibrated", **model.to_dict())
    return model
