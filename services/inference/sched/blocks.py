"""The paged KV cache's block pool: which of `num_blocks` fixed-size blocks (`block_size` tokens each) every call
holds, and which full blocks of earlier calls stay cached so a later prompt that starts the same way skips their
prefill (automatic prefix caching, as vLLM's).

Reservation is up front: `allocate` gives a call every block it can ever need (its prompt plus its max new tokens)
or nothing. A running call never waits for a block and is never preempted, so the finish admission predicted for
it, and so its deadline, holds. Cached blocks that no call holds count as free: they are evicted, least recently
used first, when a new call needs room.

A full block's key chains its tokens to its prefix's key and to a salt. The server passes the tenant's salt: a hit
makes a call measurably faster, so a cache shared across tenants is a timing side channel that tells one tenant
what another's prompts begin with. Calls with different salts never share a block; a call without one
(salt=None) neither matches nor registers.

Plain Python (no torch, no I/O): the scheduler owns one pool and calls it from the engine's thread.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ROOT_KEY = bytes(32)  # the parent of every prompt's first block: as wide as a key, so the encoding stays unambiguous


def block_key(parent_key: bytes, salt: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a full block: sha256 over (parent key, salt, the block's token ids).

    A cryptographic hash, not hash(): two blocks with one key would serve one call another prompt's k/v (wrong
    output, and across tenants a leak). Python's hash is 64 bits, cheap to collide on purpose and randomised per
    process. The encoding is injective: a 32-byte parent key, a length-prefixed salt, then 8 bytes per token (a pool
    keys blocks of one size).
    """
    digest = hashlib.sha256(parent_key)
    digest.update(struct.pack("<Q", len(salt)))
    digest.update(salt)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


@dataclass(frozen=True)
class Allocation:
    block_ids: tuple[int, ...]  # the call's block table: block i holds token positions [i*block_size, (i+1)*block_size)
    num_cached_tokens: int  # leading prompt tokens whose k/v are already cached (a multiple of block_size)


class BlockPool:
    """Every block is in exactly one state: free (no call, no key), used (held by one call or more) or cached (no
    call, registered under its key, evictable). Costs are per block touched, never per block in the pool."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.reset()

    def reset(self) -> None:
        """Forgets everything, counters included (the engine restarted: the cache's contents are gone). Block tables
        handed out before are void: do not free them."""
        self._ref_counts = [0] * self.num_blocks  # calls holding each block
        self._keys: list[bytes | None] = [None] * self.num_blocks  # a full computed block's key, else None
        self._index: dict[bytes, int] = {}  # key -> the one block registered under it
        self._free = list(range(self.num_blocks - 1, -1, -1))  # ref 0, no key; a stack, block 0 on top
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref 0, registered; least recently used first
        self.num_queried_calls = 0  # calls that looked in the cache (a salt, and allocated)
        self.num_queried_tokens = 0  # their prompt tokens
        self.num_hit_calls = 0  # of those, calls that reused at least one block
        self.num_hit_tokens = 0  # prompt tokens they did not have to compute
        self.num_evicted_blocks = 0  # cached blocks reclaimed for new calls

    @property
    def num_free(self) -> int:
        """Blocks `allocate` could hand out now: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one call."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Registered blocks no call holds: hits for later calls until evicted."""
        return len(self._cached)

    @property
    def counts(self) -> tuple[int, ...]:
        """(blocks used, blocks cached, prompt tokens the cache served, prompt tokens looked up, calls that hit,
        calls that looked, blocks evicted): the pool now, then its running totals (the step digest's last seven)."""
        return (
            self.num_used,
            self.num_cached,
            self.num_hit_tokens,
            self.num_queried_tokens,
            self.num_hit_calls,
            self.num_queried_calls,
            self.num_evicted_blocks,
        )

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def lookup(self, token_ids: Sequence[int], num_tokens: int, salt: bytes | None) -> tuple[int, int]:
        """What `allocate` would find now for the same call, pinning nothing and counting nothing: how many leading
        prompt tokens are cached, and how many blocks it would take off `num_free` (those it lacks, and its cached
        hits that no call holds). What admission predicts and plans with, before the call is admitted and allocated
        on the same thread."""
        hits = self._match(token_ids, salt)
        num_taken = self.blocks_for(num_tokens) - len(hits) + sum(1 for block in hits if block in self._cached)
        return len(hits) * self.block_size, num_taken

    def allocate(self, token_ids: Sequence[int], num_tokens: int, salt: bytes | None) -> Allocation | None:
        """Reserves the blocks of a call that will hold `num_tokens` tokens in all (its prompt `token_ids` plus its
        max new tokens), reusing and pinning the longest cached run of its leading full prompt blocks. Returns None,
        changing nothing, when the pool cannot give the rest now (always when blocks_for(num_tokens) > num_blocks).
        Never reuses the whole prompt: the model must still run the last prompt token to sample the first output.
        """
        if len(token_ids) > num_tokens:
            raise ValueError(f"num_tokens ({num_tokens}) is less than the prompt's {len(token_ids)} tokens")
        hits = self._match(token_ids, salt)
        num_new = self.blocks_for(num_tokens) - len(hits)
        if num_new > self._num_takeable(hits):
            return None
        for block in hits:
            self._cached.pop(block, None)
            self._ref_counts[block] += 1
        new = [self._take() for _ in range(num_new)]
        for block in new:
            self._ref_counts[block] = 1
        if salt is not None:
            self.num_queried_calls += 1
            self.num_queried_tokens += len(token_ids)
            self.num_hit_calls += bool(hits)
            self.num_hit_tokens += len(hits) * self.block_size
        return Allocation((*hits, *new), len(hits) * self.block_size)

    def shortfall(self, token_ids: Sequence[int], num_tokens: int, salt: bytes | None) -> int:
        """Blocks `allocate` would lack now for the same call (0: it would succeed); changes nothing."""
        hits = self._match(token_ids, salt)
        return max(self.blocks_for(num_tokens) - len(hits) - self._num_takeable(hits), 0)

    def num_released_by(self, block_ids: Sequence[int]) -> int:
        """Blocks that `free(block_ids)` would make allocatable again: those no other call holds."""
        counts = Counter(block_ids)
        return sum(1 for block, count in counts.items() if self._ref_counts[block] == count)

    def commit(
        self, block_ids: Sequence[int], token_ids: Sequence[int], num_computed_tokens: int, salt: bytes | None
    ) -> int:
        """Registers the call's blocks that are now full of computed tokens and not yet keyed, so later calls with
        the same salt can reuse them; returns how many it keyed. `token_ids` is the call's prompt and outputs so far,
        the first `num_computed_tokens` of which have k/v in its blocks; `salt` is the one it was allocated with.
        A key another block already holds keeps that block in the index (the call goes on using its own).
        """
        if salt is None:
            return 0
        num_full = num_computed_tokens // self.block_size
        if not 0 <= num_computed_tokens <= len(token_ids) or num_full > len(block_ids):
            raise ValueError(f"{num_computed_tokens} computed tokens do not fit the call's tokens and blocks")
        first = num_full  # keyed blocks are a prefix of the table: walk back over the newly full ones only
        while first > 0 and self._keys[block_ids[first - 1]] is None:
            first -= 1
        parent_key = self._keys[block_ids[first - 1]] if first else ROOT_KEY
        for i in range(first, num_full):
            block = block_ids[i]
            if not 0 <= block < self.num_blocks or self._ref_counts[block] == 0:
                raise ValueError(f"block {block} is not allocated")
            start = i * self.block_size
            parent_key = block_key(parent_key, salt, token_ids[start : start + self.block_size])
            self._keys[block] = parent_key
            self._index.setdefault(parent_key, block)
        return num_full - first

    def free(self, block_ids: Sequence[int]) -> None:
        """Releases an ended call's blocks. A registered block no call holds any more stays cached (a key whose
        holder was evicted meanwhile is taken over); any other goes back to free. The table is released last block
        first, so its tail is evicted first: a block is no use without the blocks before it. Raises ValueError,
        changing nothing, when a block is not held as often as it is listed (a double free or a stray id)."""
        for block, count in Counter(block_ids).items():
            if not 0 <= block < self.num_blocks or self._ref_counts[block] < count:
                raise ValueError(f"block {block} is not allocated (freed twice?)")
        for block in reversed(block_ids):
            self._ref_counts[block] -= 1
            if self._ref_counts[block]:
                continue
            key = self._keys[block]
            if key is not None and self._index.setdefault(key, block) == block:
                self._cached[block] = None
            else:
                self._keys[block] = None
                self._free.append(block)

    def _match(self, token_ids: Sequence[int], salt: bytes | None) -> list[int]:
        """The blocks of the longest cached run of leading full prompt blocks, short of the last prompt token."""
        if salt is None:
            return []
        hits: list[int] = []
        parent_key = ROOT_KEY
        for i in range((len(token_ids) - 1) // self.block_size):
            start = i * self.block_size
            parent_key = block_key(parent_key, salt, token_ids[start : start + self.block_size])
            block = self._index.get(parent_key)
            if block is None:
                break
            hits.append(block)
        return hits

    def _num_takeable(self, hits: Sequence[int]) -> int:
        """Blocks a call whose cached prefix is `hits` can take besides them: pinning a cached hit takes it off
        num_free."""
        return self.num_free - sum(1 for block in hits if block in self._cached)

    def _take(self) -> int:
        """A block for a new call: a free one, else the least recently used cached one, unregistered."""
        if self._free:
            return self._free.pop()
        block, _ = self._cached.popitem(last=False)
        del self._index[self._keys[block]]
        self._keys[block] = None
        self.num_evicted_blocks += 1
        return block
