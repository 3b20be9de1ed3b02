"""The KV block pool on its own: reservation, prefix caching, tenant isolation, eviction and reference counts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.inference.sched.blocks import ROOT_KEY, Allocation, BlockPool, block_key

BS = 4  # block size in most tests
SALT = b"tenant-a"


def run(pool, alloc, tokens, salt=SALT):
    """Computes the whole of `tokens` for the call and registers its full blocks."""
    return pool.commit(alloc.block_ids, tokens, len(tokens), salt)


def test_blocks_does_not_import_torch():
    code = "import sys, services.inference.sched.blocks; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_blocks_for_rounds_up():
    pool = BlockPool(8, BS)
    assert [pool.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_reserves_prompt_and_outputs_up_front():
    pool = BlockPool(8, BS)
    alloc = pool.allocate(list(range(6)), 10, SALT)
    assert alloc == Allocation(alloc.block_ids, 0)
    assert len(alloc.block_ids) == 3 and len(set(alloc.block_ids)) == 3
    assert all(0 <= b < 8 for b in alloc.block_ids)
    assert (pool.num_used, pool.num_free, pool.num_cached) == (3, 5, 0)


def test_allocate_returns_none_and_changes_nothing_when_full():
    pool = BlockPool(4, BS)
    first = pool.allocate([1, 2, 3], 12, SALT)
    assert len(first.block_ids) == 3
    assert pool.allocate([9, 9], 8, SALT) is None
    assert (pool.num_used, pool.num_free, pool.num_queried_calls) == (3, 1, 1)
    assert pool.allocate([9, 9], 17, SALT) is None  # more blocks than the pool has, ever
    last = pool.allocate([9, 9], 4, SALT)
    assert set(last.block_ids).isdisjoint(first.block_ids)
    assert pool.num_free == 0


def test_allocate_rejects_fewer_tokens_than_the_prompt():
    with pytest.raises(ValueError):
        BlockPool(4, BS).allocate([1, 2, 3], 2, SALT)


def test_full_prefix_hits_and_pins():
    pool = BlockPool(16, BS)
    prompt = list(range(10))  # two full blocks and a partial one
    a = pool.allocate(prompt, 12, SALT)
    assert run(pool, a, prompt) == 2
    b = pool.allocate(prompt, 12, SALT)
    assert b.num_cached_tokens == 8
    assert b.block_ids[:2] == a.block_ids[:2]
    assert set(b.block_ids[2:]).isdisjoint(a.block_ids)
    assert (pool.num_hit_calls, pool.num_hit_tokens, pool.num_queried_calls, pool.num_queried_tokens) == (1, 8, 2, 20)
    pool.free(a.block_ids)  # b still holds the shared prefix
    assert pool.num_used == 3 and pool.num_cached == 0
    c = pool.allocate(prompt[:9], 9, SALT)  # the shared blocks stay registered while held
    assert c.num_cached_tokens == 8 and c.block_ids[:2] == b.block_ids[:2]


def test_hit_on_cached_blocks_takes_them_off_num_free():
    pool = BlockPool(4, BS)
    prompt = list(range(9))
    a = pool.allocate(prompt, 9, SALT)
    run(pool, a, prompt)
    pool.free(a.block_ids)
    assert (pool.num_free, pool.num_cached, pool.num_used) == (4, 2, 0)
    b = pool.allocate(prompt, 16, SALT)  # two hits and two new: exactly the pool
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert (pool.num_free, pool.num_cached, pool.num_evicted_blocks) == (0, 0, 0)


def test_failed_allocation_pins_nothing():
    pool = BlockPool(4, BS)
    prompt = list(range(9))
    a = pool.allocate(prompt, 9, SALT)
    run(pool, a, prompt)
    pool.free(a.block_ids)
    assert pool.allocate(prompt, 17, SALT) is None  # 5 blocks: more than the pool even with two hits
    assert (pool.num_free, pool.num_cached, pool.num_queried_calls, pool.num_hit_calls) == (4, 2, 1, 0)


def test_hits_on_held_blocks_need_no_free_blocks():
    pool = BlockPool(4, BS)
    prompt = list(range(9))
    a = pool.allocate(prompt, 9, SALT)
    run(pool, a, prompt)
    assert pool.num_free == 1
    b = pool.allocate(prompt, 9, SALT)  # three blocks, two of them a's
    assert b.block_ids[:2] == a.block_ids[:2] and pool.num_free == 0


def test_never_matches_the_whole_prompt():
    pool = BlockPool(16, BS)
    prompt = list(range(8))  # exactly two full blocks
    a = pool.allocate(prompt, 8, SALT)
    assert run(pool, a, prompt) == 2
    b = pool.allocate(prompt, 12, SALT)
    assert b.num_cached_tokens == 4  # the last block is computed again: its last token must be sampled from
    c = pool.allocate(prompt + [8], 12, SALT)
    assert c.num_cached_tokens == 8


def test_different_salt_does_not_hit():
    pool = BlockPool(16, BS)
    prompt = list(range(9))
    run(pool, pool.allocate(prompt, 9, SALT), prompt)
    assert pool.allocate(prompt, 9, b"tenant-b").num_cached_tokens == 0
    assert pool.allocate(prompt, 9, b"").num_cached_tokens == 0
    assert pool.num_hit_calls == 0


def test_no_salt_neither_matches_nor_registers():
    pool = BlockPool(16, BS)
    prompt = list(range(9))
    a = pool.allocate(prompt, 9, None)
    assert pool.commit(a.block_ids, prompt, 9, None) == 0
    pool.free(a.block_ids)
    assert (pool.num_cached, pool.num_free) == (0, 16)  # nothing was registered: all went back to free
    b = pool.allocate(prompt, 9, SALT)
    assert b.num_cached_tokens == 0
    run(pool, b, prompt)
    assert pool.allocate(prompt, 9, None).num_cached_tokens == 0
    empty = pool.allocate(prompt, 9, b"")  # an empty salt is a salt like any other, and not None
    assert empty.num_cached_tokens == 0
    run(pool, empty, prompt, b"")
    assert pool.allocate(prompt, 9, b"").num_cached_tokens == 8
    assert pool.allocate(prompt, 9, None).num_cached_tokens == 0
    assert pool.num_queried_calls == 3  # calls without a salt never looked


def test_partial_last_block_is_never_keyed():
    pool = BlockPool(16, BS)
    prompt = list(range(7))
    a = pool.allocate(prompt, 8, SALT)
    assert run(pool, a, prompt) == 1
    pool.free(a.block_ids)
    assert pool.num_cached == 1  # the half-full block went back to free
    assert pool.allocate(prompt + [7, 8], 9, SALT).num_cached_tokens == 4


def test_commit_keys_only_computed_blocks_and_each_once():
    pool = BlockPool(16, BS)
    tokens = list(range(12))
    a = pool.allocate(tokens[:6], 12, SALT)
    assert pool.commit(a.block_ids, tokens[:6], 3, SALT) == 0  # nothing full yet
    assert pool.commit(a.block_ids, tokens[:6], 6, SALT) == 1
    assert pool.commit(a.block_ids, tokens[:6], 6, SALT) == 0
    assert pool.commit(a.block_ids, tokens, 12, SALT) == 2  # output tokens fill blocks too
    assert pool.allocate(tokens + [99], 13, SALT).num_cached_tokens == 12


def test_commit_rejects_inconsistent_counts_and_unheld_blocks():
    pool = BlockPool(8, BS)
    a = pool.allocate(list(range(8)), 8, SALT)
    with pytest.raises(ValueError):
        pool.commit(a.block_ids, list(range(8)), 9, SALT)  # more computed than tokens
    with pytest.raises(ValueError):
        pool.commit(a.block_ids[:1], list(range(8)), 8, SALT)  # more full blocks than the table
    with pytest.raises(ValueError):
        pool.commit((5, 6), list(range(8)), 8, SALT)  # blocks nobody holds


def test_keys_chain_the_prefix():
    pool = BlockPool(16, BS)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    for tokens in (c + b + [0], a + [0]):  # b is cached, but after c
        run(pool, pool.allocate(tokens, len(tokens), SALT), tokens)
    assert pool.allocate(a + b + [0], 9, SALT).num_cached_tokens == 4  # a hits; b after a does not


def test_block_key_is_deterministic_and_unambiguous():
    key = block_key(ROOT_KEY, SALT, [1, 2, 3, 4])
    assert key == block_key(bytes(32), b"tenant-a", (1, 2, 3, 4)) and len(key) == 32
    assert block_key(key, SALT, [5]) != block_key(ROOT_KEY, SALT, [5])
    assert block_key(ROOT_KEY, b"ab", [1]) != block_key(ROOT_KEY, b"a", [ord("b")])
    assert block_key(ROOT_KEY, SALT, [1, 2]) != block_key(ROOT_KEY, SALT, [2, 1])
    # the same across processes: no dependence on hash randomisation
    code = "from services.inference.sched.blocks import *; print(block_key(ROOT_KEY, b'tenant-a', [1, 2, 3, 4]).hex())"
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == key.hex()


def test_duplicate_key_keeps_the_first_block_indexed():
    pool = BlockPool(16, BS)
    prompt = list(range(5))
    a = pool.allocate(prompt, 5, SALT)
    b = pool.allocate(prompt, 5, SALT)  # both miss: nothing was registered yet
    assert b.num_cached_tokens == 0 and b.block_ids[0] != a.block_ids[0]
    run(pool, a, prompt)
    assert run(pool, b, prompt) == 1  # keyed, not indexed: b goes on using its own block
    assert pool.allocate(prompt, 5, SALT).block_ids[0] == a.block_ids[0]
    pool.free(b.block_ids)
    assert pool.num_cached == 0  # the duplicate went back to free


def test_duplicate_takes_over_a_key_whose_holder_was_evicted():
    pool = BlockPool(4, BS)
    prompt = list(range(5))
    a = pool.allocate(prompt, 5, SALT)
    b = pool.allocate(prompt, 5, SALT)
    run(pool, a, prompt)
    run(pool, b, prompt)
    pool.free(a.block_ids)  # a's first block is cached; its second went back to free
    filler = pool.allocate([7], 8, None)  # takes the free block and evicts a's first block
    assert filler.block_ids == (a.block_ids[1], a.block_ids[0]) and pool.num_evicted_blocks == 1
    pool.free(b.block_ids)
    assert pool.num_cached == 1
    assert pool.allocate(prompt, 5, SALT).block_ids[0] == b.block_ids[0]


def test_eviction_is_least_recently_used_first_and_unregisters():
    pool = BlockPool(3, BS)
    prompts = [[p] * 4 for p in (1, 2, 3)]
    allocs = [pool.allocate(p, 4, SALT) for p in prompts]
    blocks = [a.block_ids[0] for a in allocs]
    for p, a in zip(prompts, allocs):
        run(pool, a, p)
    for i in (1, 0, 2):  # freed in this order
        pool.free(allocs[i].block_ids)
    assert (pool.num_cached, pool.num_free) == (3, 3)
    touch = pool.allocate(prompts[0] + [0], 5, SALT)  # hits 0's block and evicts the least recent: 1's
    assert touch.block_ids == (blocks[0], blocks[1]) and pool.num_evicted_blocks == 1
    pool.free(touch.block_ids)  # 0's block is cached again, now the most recent
    assert (pool.num_cached, pool.num_free) == (2, 3)
    miss = pool.allocate(prompts[1] + [0], 5, SALT)  # 1's key left the index with its block
    assert miss.num_cached_tokens == 0
    assert miss.block_ids == (blocks[1], blocks[2])  # the free block, then the least recent cached one: 2's
    assert pool.num_evicted_blocks == 2
    pool.free(miss.block_ids)
    assert pool.allocate(prompts[2] + [0], 5, SALT).num_cached_tokens == 0


def test_a_freed_call_releases_its_tail_first():
    pool = BlockPool(3, BS)
    prompt = list(range(9))
    a = pool.allocate(prompt, 12, SALT)
    run(pool, a, prompt)  # blocks 0 and 1 keyed, block 2 partial
    pool.free(a.block_ids)
    assert (pool.num_cached, pool.num_free) == (2, 3)
    pool.free(pool.allocate([7], 8, None).block_ids)  # the free block, then one eviction: the second block
    assert pool.num_evicted_blocks == 1
    assert pool.allocate(prompt, 9, SALT).num_cached_tokens == 4


def test_shared_prefix_is_reference_counted():
    pool = BlockPool(8, BS)
    prompt = list(range(9))
    a = pool.allocate(prompt, 12, SALT)
    run(pool, a, prompt)
    b = pool.allocate(prompt, 12, SALT)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert pool.num_used == 4
    pool.free(b.block_ids)
    assert (pool.num_used, pool.num_cached) == (3, 0)  # a still holds the shared blocks
    pool.free(a.block_ids)
    assert (pool.num_used, pool.num_cached, pool.num_free) == (0, 2, 8)


def test_double_free_and_stray_blocks_raise_and_change_nothing():
    pool = BlockPool(8, BS)
    a = pool.allocate(list(range(5)), 8, SALT)
    pool.free(a.block_ids)
    with pytest.raises(ValueError):
        pool.free(a.block_ids)
    b = pool.allocate([1], 4, SALT)
    with pytest.raises(ValueError):
        pool.free((*b.block_ids, *b.block_ids))  # listed twice, held once
    with pytest.raises(ValueError):
        pool.free((*b.block_ids, 8))
    with pytest.raises(ValueError):
        pool.free((-1,))
    assert pool.num_used == 1
    pool.free(b.block_ids)
    assert pool.num_free == 8


def test_reset_forgets_everything():
    pool = BlockPool(4, BS)
    prompt = list(range(9))
    a = pool.allocate(prompt, 9, SALT)
    run(pool, a, prompt)
    pool.allocate(prompt, 9, SALT)
    pool.reset()
    assert (pool.num_free, pool.num_used, pool.num_cached) == (4, 0, 0)
    assert (pool.num_hit_calls, pool.num_hit_tokens, pool.num_queried_tokens, pool.num_queried_calls) == (0, 0, 0, 0)
    with pytest.raises(ValueError):
        pool.free(a.block_ids)  # tables from before the reset are void
    assert pool.allocate(prompt, 9, SALT).num_cached_tokens == 0


def test_rejects_empty_pools():
    with pytest.raises(ValueError):
        BlockPool(0, BS)
    with pytest.raises(ValueError):
        BlockPool(4, 0)


class PoolMachine(RuleBasedStateMachine):
    """Random calls over a small pool with few distinct prompts (so hits, sharing and eviction happen), checked
    against a model of what each block holds."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(12, 2)
        self.calls = []  # [allocation, tokens, num_tokens, num_computed, salt]
        self.content = {}  # block -> (salt, the tokens up to its end) that a commit wrote in it

    @rule(
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=9),
        extra=st.integers(0, 4),
        salt=st.sampled_from([b"a", b"b", None]),
    )
    def allocate(self, prompt, extra, salt):
        pool, bs = self.pool, self.pool.block_size
        num_free, num_tokens = pool.num_free, len(prompt) + extra
        alloc = pool.allocate(prompt, num_tokens, salt)
        if alloc is None:
            assert pool.blocks_for(num_tokens) > num_free and pool.num_free == num_free
            return
        assert len(alloc.block_ids) == pool.blocks_for(num_tokens)
        assert alloc.num_cached_tokens % bs == 0 and alloc.num_cached_tokens < len(prompt)
        held = {b for call in self.calls for b in call[0].block_ids}
        num_hits = alloc.num_cached_tokens // bs
        for i, block in enumerate(alloc.block_ids):
            if i < num_hits:  # a hit holds exactly this prefix, computed under this salt
                assert salt is not None and self.content[block] == (salt, tuple(prompt[: (i + 1) * bs]))
            else:  # a new block is nobody else's, and whatever it held is about to be overwritten
                assert block not in held
                self.content.pop(block, None)
        self.calls.append([alloc, list(prompt), num_tokens, alloc.num_cached_tokens, salt])

    @precondition(lambda self: self.calls)
    @rule(pick=st.integers(0, 100), num_steps=st.integers(1, 5), token=st.integers(0, 2))
    def step(self, pick, num_steps, token):
        call = self.calls[pick % len(self.calls)]
        alloc, tokens, num_tokens, num_computed, salt = call
        for _ in range(num_steps):  # prefill one token at a time, then decode
            if num_computed < len(tokens):
                num_computed += 1
            elif len(tokens) < num_tokens:
                tokens.append(token)
        call[3] = num_computed
        self.pool.commit(alloc.block_ids, tokens, num_computed, salt)
        if salt is not None:
            bs = self.pool.block_size
            for i in range(num_computed // bs):
                self.content.setdefault(alloc.block_ids[i], (salt, tuple(tokens[: (i + 1) * bs])))

    @precondition(lambda self: self.calls)
    @rule(pick=st.integers(0, 100))
    def free(self, pick):
        alloc = self.calls.pop(pick % len(self.calls))[0]
        self.pool.free(alloc.block_ids)

    @invariant()
    def counts_add_up(self):
        pool = self.pool
        held = {b for call in self.calls for b in call[0].block_ids}
        assert pool.num_used == len(held)
        assert pool.num_free + pool.num_used == pool.num_blocks
        assert 0 <= pool.num_cached <= pool.num_free

    @invariant()
    def shared_blocks_hold_the_same_prefix(self):
        holders = {}
        for alloc, tokens, _, _, salt in self.calls:
            for i, block in enumerate(alloc.block_ids):
                holders.setdefault(block, []).append((i, salt, tuple(tokens[: (i + 1) * self.pool.block_size])))
        for block, seen in holders.items():
            assert len(set(seen)) == 1, f"block {block} handed to calls with different contents: {seen}"

    def teardown(self):
        for call in self.calls:
            self.pool.free(call[0].block_ids)
        assert (self.pool.num_free, self.pool.num_used) == (self.pool.num_blocks, 0)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
