"""The server's grammar compiler: before a constrained call is admitted, its constraint is compiled once here, off the
event loop, so that a malformed or too complex one is refused precisely (INVALID_ARGUMENT naming the field) and a
compile that cannot fit the call's budget is refused at once (DEADLINE_INFEASIBLE). What each compile cost is
kept by constraint key (bounded): the engine compiles its own copy once (engine/grammars.py), and admission counts
that compile against the call that brings a new constraint; a cached one costs nothing.

Compile time is predicted, before compiling, from the grammar's size: a line through calibrated compiles of
realistic schemas (`calibrate`), followed online as every compile is measured, as the step cost model is. No torch.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tokenizers import Tokenizer

from .grammar import (
    Constraint,
    ConstraintKind,
    GrammarLimits,
    compile_matcher,
    grammar_tokenizer,
    make_constraint,
    support_error,
)

# realistic schemas of three sizes (a tool call, an order, a catalogue entry): the compile-time line runs through them
CALIBRATION_SCHEMAS = (
    '{"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, '
    '"required": ["city"]}',
    '{"type": "object", "properties": {"id": {"type": "string"}, "lines": {"type": "array", "items": {"type": '
    '"object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": '
    '{"type": "number"}}, "required": ["sku", "qty"]}}, "paid": {"type": "boolean"}, "note": {"type": "string"}}, '
    '"required": ["id", "lines"]}',
    '{"type": "object", "properties": {'
    + ", ".join(f'"field{i}": {{"type": "string", "enum": ["a{i}", "b{i}", "c{i}"]}}' for i in range(40))
    + ', "tags": {"type": "array", "items": {"type": "string"}}, "meta": {"type": "object", "properties": '
    '{"created": {"type": "string"}, "n": {"type": "integer"}}}}, "required": ["field0"]}',
)


class CompileTooSlow(Exception):
    """The constraint's compile is predicted (nothing compiles), or was seen (`still_compiling`: it goes on and is
    cached), not to fit the call's budget."""

    def __init__(self, compile_ms: int, still_compiling: bool = False) -> None:
        super().__init__(f"compiling the response_format takes about {compile_ms} ms")
        self.compile_ms = compile_ms
        self.still_compiling = still_compiling


class CompilesBusy(Exception):
    """Too many distinct constraints are compiling at once on this replica; `retry_after_ms` is when they end."""

    def __init__(self, retry_after_ms: int) -> None:
        super().__init__(f"the replica is compiling other grammars; retry in {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


@dataclass
class CompileCost:
    """µs to compile a grammar of n bytes: base + per_byte × n, from calibration, times a running ratio of
    measured over predicted (and `num_deviations` of its deviation), as cost/model.py follows steps."""

    base_us: float = 1000.0
    us_per_byte: float = 1.0
    ratio: float = 1.0
    deviation: float = 0.1
    alpha: float = 0.1
    num_deviations: float = 3.0

    def predict_us(self, num_bytes: int) -> float:
        return (self.base_us + self.us_per_byte * num_bytes) * (self.ratio + self.num_deviations * self.deviation)

    def fit(self, points: list[tuple[int, float]]) -> None:
        """Least squares through (bytes, µs), neither term negative."""
        n = len(points)
        mean_x = sum(x for x, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        var_x = sum((x - mean_x) ** 2 for x, _ in points)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var_x if var_x else 0.0
        self.us_per_byte = max(slope, 0.0)
        self.base_us = max(mean_y - self.us_per_byte * mean_x, min(y for _, y in points) / 2)

    def observe(self, num_bytes: int, measured_us: float) -> None:
        ratio = measured_us / max(self.base_us + self.us_per_byte * num_bytes, 1.0)
        self.ratio += self.alpha * (ratio - self.ratio)
        self.deviation += self.alpha * (abs(ratio - self.ratio) - self.deviation)


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop_token_ids: Iterable[int],
        limits: GrammarLimits,
        capacity: int = 256,
        max_compiling: int = 4,
    ) -> None:
        self.limits = limits
        self.cost = CompileCost()
        self.capacity = capacity  # the engine's cache holds as many (engine/grammars.py)
        self.max_compiling = max_compiling
        self._tokenizer = grammar_tokenizer(tokenizer, stop_token_ids)
        self._compiled: OrderedDict[str, int] = OrderedDict()  # key -> its compile's µs, least recent first
        self._compiling: dict[str, asyncio.Future] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-check")

    def calibrate(self, schemas: tuple[str, ...] = CALIBRATION_SCHEMAS, repeats: int = 3) -> None:
        """Fits the compile-time line on realistic schemas (at warm-up, off the event loop)."""
        points = []
        for schema in schemas:
            constraint = make_constraint(ConstraintKind.JSON_SCHEMA, schema, self.limits)
            runs = [self._timed_compile(constraint)[1] for _ in range(repeats)]
            points.append((constraint.num_grammar_bytes, sorted(runs)[len(runs) // 2]))
        self.cost.fit(points)

    def _timed_compile(self, constraint: Constraint) -> tuple[Constraint, float]:
        started = time.perf_counter_ns()
        # GrammarError when it is bad, or generates nothing (its first mask): refused before admission, not mid-call
        compile_matcher(self._tokenizer, constraint, self.limits).check_start()
        return constraint, (time.perf_counter_ns() - started) / 1000

    def support_error(self, tokenizer: Tokenizer) -> str:
        """Why this model's tokenizer cannot be served under grammars ('' when it can): grammar.support_error."""
        return support_error(tokenizer, self._tokenizer, self.limits)

    async def prepare(self, constraint: Constraint, budget_ns: int) -> int:
        """Compiles `constraint` unless cached, inside `budget_ns`; returns the µs the compile took (0 when cached:
        then the engine has it too, and the call's first step waits for no compile). CompileTooSlow when it is
        predicted not to fit
        (nothing is compiled) or does not finish in time (it goes on, and is cached for the next call),
        CompilesBusy when too many others compile, GrammarError when it is malformed or too complex."""
        key = constraint.key
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return 0
        predicted_us = self.cost.predict_us(constraint.num_grammar_bytes)
        # the server's compile, then the engine's: both before the call's first step
        if 2 * predicted_us * 1000 >= budget_ns:
            raise CompileTooSlow(math.ceil(2 * predicted_us / 1000))
        future = self._compiling.get(key)
        if future is None:
            if len(self._compiling) >= self.max_compiling:
                raise CompilesBusy(math.ceil(predicted_us * len(self._compiling) / 1000))
            loop = asyncio.get_running_loop()
            future = self._compiling[key] = loop.run_in_executor(self._pool, self._timed_compile, constraint)
            future.add_done_callback(lambda done: self._done(key, done))
        started_ns = time.monotonic_ns()
        try:
            _, compile_us = await asyncio.wait_for(asyncio.shield(future), budget_ns / 1e9)
        except TimeoutError:
            raise CompileTooSlow(
                math.ceil(2 * (time.monotonic_ns() - started_ns) / 1e6), still_compiling=True
            ) from None
        return int(compile_us)

    def _done(self, key: str, future: asyncio.Future) -> None:
        """On the event loop, once a compile ends: the next call with `key` finds it cached (a failed one is not)."""
        self._compiling.pop(key, None)
        if future.cancelled() or future.exception() is not None:
            return
        constraint, compile_us = future.result()
        self.cost.observe(constraint.num_grammar_bytes, compile_us)
        self._compiled[key] = int(compile_us)
        while len(self._compiled) > self.capacity:
            self._compiled.popitem(last=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
