"""Deadline admission's KV pool, in the server: the paged cache's blocks (sched/blocks.py), reserved when a call is
admitted rather than when the engine starts it, so that the cached prefix admission predicted with is pinned at the
decision and the prediction holds (nothing evicts a pinned block, and the engine never waits for one).

The engine gets each call with its block table (`Request.blocks_reserved`) and leaves the blocks to this pool: it
keys a call's prompt blocks once its first token shows the prompt computed, its answer's blocks when it finishes
(a chat's next turn sends the answer back), and frees them when the call ends however it ends. A block is keyed
only once the engine has computed it, so a block a cancelled call's last step may still write is never shared.

The pool is sized with room for the calls admitted into slots that free at the end of the running step (their
predecessors still hold blocks until their end arrives): the executor allocates twice the blocks of every slot at
the longest context where memory allows (device/executor.py). Where it does not (a long max_seq_len), the slots can
hold more calls than the pool has blocks for, and admission plans the blocks on its calendar beside the slots
(`planned`): a call whose blocks are not free for its whole run is refused for blocks with the time they are, and
they are reserved for its retry as a slot is. A call admitted that the pool still cannot take now (a call that has
ended later than its predicted finish has not given its blocks back yet; a shared prefix is given back only by the
last call that holds it) is refused for blocks without a reservation, its hint the predicted finish of the running
calls whose blocks it needs back (`ready_at_ns`).
"""

from __future__ import annotations

from collections.abc import Iterable

from services import errors

from .admission import RefusalCause
from .call import Ticket
from .sched.blocks import BlockPool
from .sched.request import FinishReason, Request


class KvReservations:
    """`planned`: the pool has fewer blocks than the slots could fill at the longest context, so admission plans
    its blocks on the calendar beside the slots (a call's `num_blocks`, `num_free`), and a refusal for blocks
    reserves them for the retry. Where it holds every slot's longest call, the slots bind first and blocks are not
    planned (the executor sizes it at twice that where memory allows)."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int = 0, max_seq_len: int = 0) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.planned = num_blocks < num_slots * self.pool.blocks_for(max_seq_len)

    @property
    def num_free(self) -> int:
        """Blocks a call could take now (free, or cached and evictable)."""
        return self.pool.num_free

    def lookup(self, prompt: tuple[int, ...], max_tokens: int, salt: bytes | None) -> tuple[int, int]:
        """What admission predicts and plans with: the prompt's leading tokens cached now, and the blocks the call
        would take off the pool's free ones (nothing pinned yet)."""
        return self.pool.lookup(prompt, len(prompt) + max_tokens, salt)

    def reserve(self, request: Request) -> bool:
        """Reserves the admitted call's blocks, its cached prefix pinned; False when the pool lacks them now."""
        num_tokens = request.num_prompt_tokens + request.sampling.max_tokens
        allocation = self.pool.allocate(request.prompt_token_ids, num_tokens, request.cache_salt)
        if allocation is None:
            return False
        request.block_ids, request.blocks_reserved = allocation.block_ids, True
        request.num_cached_tokens = request.num_computed_tokens = allocation.num_cached_tokens
        return True

    def take_at_start(self, ticket: Ticket) -> bool:
        """A held call whose blocks admission planned for its start (it took none when admitted) starts: they are
        reserved now. False: the running calls have not given them back yet (one ended later than predicted), and
        it waits for them."""
        if not self.reserve(ticket.request):
            return False
        ticket.kv_blocks = ticket.request.block_ids
        return True

    def refusal(
        self, request: Request, running: Iterable[Ticket], finish_ns: int, now_ns: int, budget_ns: int
    ) -> errors.Overloaded:
        """The refusal of a call admitted that the pool cannot take now (`reserve` said False): no reservation,
        its hint when the running calls whose blocks it needs are predicted to give them back."""
        ready_ns = self.ready_at_ns(request, running) or finish_ns
        retry_ms = max(-(-(ready_ns - now_ns) // 1_000_000), 1)
        run_ms = (finish_ns - now_ns) // 1_000_000
        return errors.Overloaded(retry_ms, run_ms, budget_ns // 1_000_000, cause=RefusalCause.KV_BLOCKS)

    def ready_at_ns(self, request: Request, running: Iterable[Ticket]) -> int | None:
        """When the pool could give `request` its blocks, counting the blocks each running call gives back at its
        predicted finish, earliest first: admission's hint for a call it refuses for blocks. None: it could now,
        or the running calls' ends never free enough (blocks shared with a later call stay held)."""
        num_tokens = request.num_prompt_tokens + request.sampling.max_tokens
        missing = self.pool.shortfall(request.prompt_token_ids, num_tokens, request.cache_salt)
        if missing == 0:
            return None
        for ticket in sorted(running, key=lambda t: t.predicted_finish_ns):
            missing -= self.pool.num_released_by(ticket.kv_blocks)
            if missing <= 0:
                return ticket.predicted_finish_ns
        return None

    def first_token(self, ticket: Ticket) -> None:
        """The engine has computed the whole prompt: its full blocks are keyed for later calls."""
        request = ticket.request
        if ticket.kv_blocks and request.cache_salt is not None:
            prompt = request.prompt_token_ids
            self.pool.commit(ticket.kv_blocks, prompt, len(prompt), request.cache_salt)

    def end(self, ticket: Ticket) -> None:
        """The call ended: a finished call's answer blocks are keyed (its last token was never computed), then every
        block goes back, cached ones kept for later hits. Idempotent."""
        if not ticket.kv_blocks:
            return
        request = ticket.request
        if ticket.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and request.cache_salt is not None:
            tokens = (*request.prompt_token_ids, *ticket.output_token_ids)
            computed = min(len(tokens), request.num_prompt_tokens + ticket.num_output_tokens - 1)
            self.pool.commit(ticket.kv_blocks, tokens, computed, request.cache_salt)
        self.pool.free(ticket.kv_blocks)
        ticket.kv_blocks = ()
