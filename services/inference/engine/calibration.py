"""Calibrates the cost model at warm-up by running synthetic steps through the real engine path."""

from __future__ import annotations

import itertools
import random
import statistics
from dataclasses import replace

import structlog

from ..cost.model import CostModel, fit_context_cost
from ..grammar import ConstraintKind, make_constraint
from ..sched.request import Request, SamplingParams
from .engine import Engine, RequestOutput

log = structlog.get_logger(__name__)


class _Discard:
    def put(self, output: RequestOutput) -> None:
        pass


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)  # frozen: a shared default is safe
# the prefix cache's salts are its tenants' (policy/gate.py): no call shares calibration's blocks, and the warming
# engine that holds them is dropped once calibrated
CALIBRATION_SALT = b"zeroqueue:calibration"
PREFILL_ROWS = 64  # prompt tokens prefilled after a cached prefix, in one step
# What a constrained row costs is calibrated on a realistic schema (objects in an array, strings, integers, an enum):
# its mask varies with where the output is in the grammar, and a run of steps walks through several places.
CALIBRATION_SCHEMA = (
    '{"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": '
    '{"name": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "kind": {"enum": ["tool", "part"]}}, '
    '"required": ["name", "qty", "kind"]}}}, "required": ["items"]}'
)


def _decode_step_us(
    engine: Engine, batch: int, prompt_len: int, num_steps: int, rng: random.Random, sampling: SamplingParams = GREEDY
) -> float:
    """Median interval of decode-only steps with `batch` requests whose context is about `prompt_len`, each drawn
    with `sampling` (its max_tokens aside)."""
    vocab = engine.executor.model.args.vocab_size
    # the first requests decode while later prompts are still filled in chunks: outlast that
    prefill_steps = -(-batch * prompt_len // engine.scheduler.config.max_num_batched_tokens)
    for i in range(batch):
        prompt = tuple(rng.randrange(vocab) for _ in range(prompt_len))
        request = Request(
            f"calibrate-{batch}-{prompt_len}-{i}",
            prompt,
            replace(sampling, max_tokens=prefill_steps + num_steps + 1),
            engine.clock(),
        )
        engine.add_request(request, _Discard())
    times = []
    while engine.has_work:
        report = engine.step()
        if report is not None and not report.scheduled.prefills and len(report.scheduled.decodes) == batch:
            times.append(report.interval_ns / 1000)
    return statistics.median(times)


def _pool_holds(engine: Engine, batch: int, prompt_len: int, num_steps: int) -> bool:
    """Whether the KV pool holds `batch` of _decode_step_us's calls at once: the slots may hold more calls than
    the pool has blocks for (a long max_seq_len), and a step of fewer rows than asked would measure nothing."""
    prefill_steps = -(-batch * prompt_len // engine.scheduler.config.max_num_batched_tokens)
    pool = engine.scheduler.blocks
    return batch * pool.blocks_for(prompt_len + prefill_steps + num_steps + 1) <= pool.num_blocks


def _prefill_step_us(engine: Engine, num_tokens: int, repeats: int, rng: random.Random) -> float:
    vocab = engine.executor.model.args.vocab_size
    times = []
    for r in range(repeats):
        prompt = tuple(rng.randrange(vocab) for _ in range(num_tokens))
        times.append(_first_step_us(engine, f"calibrate-prefill-{num_tokens}-{r}", prompt, None))
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
        if n <= slots and _pool_holds(engine, n, 4, num_steps):  # else the cost model extrapolates
            rows.append(n)
            row_us.append(_decode_step_us(engine, n, 4, num_steps, rng))
        elif slots < n <= min(budget, max_prompt):
            rows.append(n)
            row_us.append(_prefill_step_us(engine, n, repeats, rng))
    batch = min(8, slots)
    while batch > 1 and batch not in rows:  # a pool smaller than 8 short calls
        batch //= 2
    long_ctx = min(engine.executor.max_seq_len // 2, 512)
    while long_ctx > 16 and not _pool_holds(engine, batch, long_ctx, num_steps):  # a long max_seq_len, a small pool
        long_ctx //= 2
    short_us = row_us[rows.index(batch)] if batch in rows else _decode_step_us(engine, batch, 4, num_steps, rng)
    long_us = _decode_step_us(engine, batch, long_ctx, num_steps, rng)
    per_ctx = fit_context_cost(batch * 4, short_us, batch * long_ctx, long_us)
    masked_us, logprob_us = _extra_row_us(engine, batch, short_us, num_steps, rng)
    # a bigger step never takes less time; noise must not make the curve dip
    model = CostModel(
        rows=rows,
        row_us=list(itertools.accumulate(row_us, max)),
        us_per_context_token=per_ctx,
        us_per_masked_row=masked_us,
        us_per_logprob_row=logprob_us,
        us_per_prefill_context_token=_prefill_context_us(engine, repeats, rng),
    )
    log.info("cost_model_calibrated", **model.to_dict())
    return model


def _prefill_context_us(engine: Engine, repeats: int, rng: random.Random) -> float:
    """What a prompt row prefilled after a cached prefix adds per cached position it reads (its attention): a step
    that prefills PREFILL_ROWS prompt tokens after a cached prefix, less the same step cold, per row and position.
    The prefix is computed by a call of its own first, as a tenant's earlier call computes it."""
    pool, budget = engine.scheduler.blocks, engine.scheduler.config.max_num_batched_tokens
    num_rows = min(PREFILL_ROWS, budget)
    num_cached = min(engine.executor.max_seq_len - num_rows - 1, 512) // pool.block_size * pool.block_size
    if num_cached <= 0:
        return 0.0
    vocab = engine.executor.model.args.vocab_size
    cold, cached = [], []
    for r in range(repeats):
        prefix = tuple(rng.randrange(vocab) for _ in range(num_cached))
        _first_step_us(engine, f"calibrate-prefix-{r}", (*prefix, 0), CALIBRATION_SALT)  # computes and keys it
        rows = tuple(rng.randrange(vocab) for _ in range(num_rows))
        cold.append(_first_step_us(engine, f"calibrate-cold-{r}", rows, None))
        cached.append(_first_step_us(engine, f"calibrate-cached-{r}", (*prefix, *rows), CALIBRATION_SALT))
    return fit_context_cost(0, statistics.median(cold), num_rows * num_cached, statistics.median(cached))


def _first_step_us(engine: Engine, call_id: str, prompt: tuple[int, ...], salt: bytes | None) -> float:
    """The time of a call's first step (its prompt, whole, less what the cache holds), run to its end alone."""
    request = Request(call_id, prompt, replace(GREEDY, max_tokens=1), engine.clock(), cache_salt=salt)
    engine.add_request(request, _Discard())
    report = engine.step()
    while engine.has_work:
        engine.step()
    return report.interval_ns / 1000


def _extra_row_us(
    engine: Engine, batch: int, plain_us: float, num_steps: int, rng: random.Random
) -> tuple[float, float]:
    """The host time one row adds to a decode step of `batch` rows (whose plain step takes `plain_us`): under a
    grammar's mask (CALIBRATION_SCHEMA, compiled first, as a call's is before its first step), and reporting
    20 log-probabilities. Each is that batch's step, every row so drawn, less the plain step, per row."""
    masked_us = plain_us
    why = engine.grammars.support_error()
    if why:  # the server refuses every response_format too (replica.py): no constrained row will be in a step
        log.warning("grammar_calibration_skipped", why=why)
    else:
        constraint = make_constraint(ConstraintKind.JSON_SCHEMA, CALIBRATION_SCHEMA, engine.grammars.limits)
        masked = SamplingParams(temperature=0.0, ignore_eos=True, constraint=constraint)
        _decode_step_us(engine, 1, 4, 2, rng, masked)  # the compile, and the matcher's first masks, stay out
        masked_us = _decode_step_us(engine, batch, 4, num_steps, rng, masked)
    logprobs = SamplingParams(temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=20)
    logprob_us = _decode_step_us(engine, batch, 4, num_steps, rng, logprobs)
    return max(masked_us - plain_us, 0.0) / batch, max(logprob_us - plain_us, 0.0) / batch
