"""Iteration-level scheduling: requests join and leave between steps. No torch here.

Each step runs one decode token for every running request past its prompt, then spends what is left of the
step's token budget on prompt chunks, oldest request first, so a long prompt never stalls running decodes.
Waiting requests start in arrival order or, with `earliest_deadline_first` (deadline admission's engine), the one
whose deadline comes first: a call admitted for a later start (held in its slack) that finds its slot late then
goes ahead of calls admitted after it, whose deadlines are later, rather than behind every one the calendar planned
for an earlier slot.
A request starts only with a slot and every KV block it may need (its prompt plus its max_tokens) reserved,
less the blocks of its prompt's cached prefix (blocks.py): nothing running is ever preempted.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from .blocks import BlockPool
from .request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    num_slots: int  # the most sequences that can be in flight
    max_seq_len: int  # tokens one sequence may hold
    max_num_batched_tokens: int = 256  # tokens per step: decodes plus prefill chunks
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 0  # KV blocks in the pool; 0: enough for every slot at max_seq_len
    earliest_deadline_first: bool = False  # waiting requests by deadline (none: last), ties in arrival order

    def __post_init__(self) -> None:
        if self.num_slots <= 0 or self.max_seq_len <= 0 or self.block_size <= 0 or self.num_blocks < 0:
            raise ValueError("num_slots, max_seq_len and block_size must be positive, num_blocks not negative")
        if self.max_num_batched_tokens < self.num_slots + 1:
            raise ValueError("max_num_batched_tokens must exceed num_slots so prefill always progresses")

    @property
    def pool_blocks(self) -> int:
        return self.num_blocks or self.num_slots * -(-self.max_seq_len // self.block_size)


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    block_ids: tuple[int, ...]  # its KV block table
    start_pos: int  # position of the first token run this step
    token_ids: tuple[int, ...]  # tokens run this step
    sample: bool  # the last token's logits are sampled into a new token

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    decodes: tuple[ScheduledSeq, ...]  # one token each
    prefills: tuple[ScheduledSeq, ...]  # prompt chunks
    expired: tuple[Request, ...]  # ended before this step; their slots and blocks are already free

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_tokens for s in self.prefills)

    @property
    def num_seqs(self) -> int:
        return len(self.decodes) + len(self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def context_tokens(self) -> int:
        """Cache positions the decode rows attend to, summed (each also attends to its own new token)."""
        return sum([s.start_pos for s in self.decodes]) + len(self.decodes)

    @property
    def prefill_context_tokens(self) -> int:
        """Cache positions before its chunk that each prompt row attends to (a cached prefix, earlier chunks),
        summed over the rows: the attention a chunk does beyond a cold chunk of its size."""
        return sum([s.num_tokens * s.start_pos for s in self.prefills]) if self.prefills else 0


@dataclass(frozen=True)
class StepUpdate:
    request: Request
    new_token_id: int | None  # None while the prompt is still being filled


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots: list[int] = list(range(config.num_slots - 1, -1, -1))
        self.blocks = BlockPool(config.pool_blocks, config.block_size)
        self.requests: dict[str, Request] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    @property
    def kv_counts(self) -> tuple[int, ...]:
        """The pool's counts (BlockPool.counts), as each step's digest carries them."""
        return self.blocks.counts

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        if request.call_id in self.requests:
            raise ValueError(f"request {request.call_id!r} is already scheduled")
        if request.num_prompt_tokens + request.sampling.max_tokens > self.config.max_seq_len:
            raise ValueError(f"request {request.call_id!r} needs more than {self.config.max_seq_len} tokens")
        self.requests[request.call_id] = request
        if not self.config.earliest_deadline_first or request.deadline_ns is None:
            self.waiting.append(request)
            return
        i = len(self.waiting)  # from the back: most requests arrive with the latest deadline so far
        while i and _deadline(self.waiting[i - 1]) > request.deadline_ns:
            i -= 1
        self.waiting.insert(i, request)

    def finish_requests(self, call_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends requests (cancelled, stopped by a stop string) and frees their slots and blocks at once."""
        ended = []
        for call_id in call_ids:
            request = self.requests.get(call_id)
            if request is not None and not request.is_finished:
                self._finish(request, status)
                ended.append(request)
        return ended

    def next_step_size(self) -> tuple[int, int]:
        """(rows, context tokens) of the next step if no request ends before it: a token of each decoding request
        and as much prompt still to fill as the step's token budget takes. A bound from above: requests that end
        first, or wait for a slot or blocks, only make the step smaller."""
        num_decodes = context_tokens = num_pending = 0
        for r in self.running:
            if r.is_prefilling:
                num_pending += r.num_remaining_prompt_tokens
            else:
                num_decodes += 1
                context_tokens += r.num_computed_tokens + 1  # as SchedulerOutput.context_tokens counts it
        room = max(self.config.max_num_batched_tokens - num_decodes, 0)
        if self.free_slots:
            for r in self.waiting:
                if num_pending >= room:
                    break
                num_pending += r.num_remaining_prompt_tokens
        return num_decodes + min(num_pending, room), context_tokens

    def schedule(self, now_ns: int, expiry_guard_ns: int = 0) -> SchedulerOutput:
        """Picks the next step's work; requests whose deadline falls within `expiry_guard_ns` end first."""
        expired = [
            r
            for r in (*self.running, *self.waiting)
            if r.deadline_ns is not None and r.deadline_ns - expiry_guard_ns <= now_ns
        ]
        for request in expired:
            self._finish(request, RequestStatus.FINISHED_EXPIRED)
        decodes = [
            ScheduledSeq(r, r.block_ids, r.num_computed_tokens, (r.token_at(r.num_computed_tokens),), True)
            for r in self.running
            if not r.is_prefilling
        ]
        budget = self.config.max_num_batched_tokens - len(decodes)
        prefills = []
        for request in self.running:
            if request.is_prefilling and budget > 0:
                prefills.append(self._chunk(request, budget))
                budget -= prefills[-1].num_tokens
        while self.waiting and self.free_slots and budget > 0:
            request = self.waiting[0]
            if not self._reserve(request):
                break  # in order: a later, smaller request does not overtake it
            self.waiting.popleft()
            request.slot = self.free_slots.pop()
            request.status = RequestStatus.RUNNING
            request.first_scheduled_ns = now_ns
            self.running.append(request)
            prefills.append(self._chunk(request, budget))
            budget -= prefills[-1].num_tokens
        return SchedulerOutput(tuple(decodes), tuple(prefills), tuple(expired))

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[StepUpdate]:
        """Advances every scheduled request by what the step computed and ends those that are done."""
        updates = []
        for seq in (*output.decodes, *output.prefills):
            request = seq.request
            if request.is_finished:  # cancelled while the step ran
                continue
            request.num_computed_tokens += seq.num_tokens
            self._keep_full_blocks(request, seq.num_tokens)
            token = sampled.get(request.call_id) if seq.sample else None
            if token is not None:
                request.output_token_ids.append(token)
                status = self._stop_status(request, token)
                if status is not None:
                    self._finish(request, status)
            updates.append(StepUpdate(request, token))
        return updates

    def _reserve(self, request: Request) -> bool:
        """Reserves the request's blocks, its cached prefix's among them; False when the pool lacks them now."""
        if request.blocks_reserved:  # admission's pool reserved them (and its cached prefix) when it admitted it
            return True
        num_tokens = request.num_prompt_tokens + request.sampling.max_tokens
        allocation = self.blocks.allocate(request.prompt_token_ids, num_tokens, request.cache_salt)
        if allocation is None:
            return False
        request.block_ids = allocation.block_ids
        request.num_cached_tokens = request.num_computed_tokens = allocation.num_cached_tokens
        return True

    def _keep_full_blocks(self, request: Request, num_new: int) -> None:
        """Offers the blocks this step filled to the prefix cache (only when a step crossed a block's end)."""
        done, bs = request.num_computed_tokens, self.config.block_size
        if request.cache_salt is None or request.blocks_reserved or done // bs == (done - num_new) // bs:
            return
        tokens = (*request.prompt_token_ids, *request.output_token_ids)
        self.blocks.commit(request.block_ids, tokens, request.num_computed_tokens, request.cache_salt)

    def _chunk(self, request: Request, budget: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        n = min(budget, request.num_remaining_prompt_tokens)
        tokens = request.prompt_token_ids[start : start + n]
        return ScheduledSeq(request, request.block_ids, start, tokens, sample=start + n == request.num_prompt_tokens)

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        if token in request.sampling.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_remaining_output_tokens <= 0 or request.num_tokens >= self.config.max_seq_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request.slot is not None:
            self.free_slots.append(request.slot)
            request.slot = None
        if request.block_ids and not request.blocks_reserved:
            self.blocks.free(request.block_ids)
            request.block_ids = ()
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        del self.requests[request.call_id]


def _deadline(request: Request) -> float:
    return math.inf if request.deadline_ns is None else request.deadline_ns
