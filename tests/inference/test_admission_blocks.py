"""Admission plans the paged KV pool where it has fewer blocks than the slots could fill: a running call holds its
blocks until its end as it holds its slot; a call whose blocks free later is held for them (by default), or, with
`--no-hold-blocks`, refused with a reservation of them, so the freed blocks wait for its hinted retry instead of
going to whoever comes first. Driven as the service drives it (the pool
looked up at arrival, an admitted call's blocks allocated at once, freed at its end), on a known step time; no torch.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.inference.admission import (
    DEFAULT_SETTINGS,
    AdmissionConfig,
    AdmissionController,
    AdmissionSettings,
    Admit,
    Commitment,
    Reject,
)
from services.inference.admission.decisions import RefusalCause
from services.inference.admission.predictor import progressed
from services.inference.kv_pool import KvReservations
from tests.inference.test_admission import MS, REFUSING, flat_cost

BLOCK, CONTEXT, SLOTS = 16, 512, 4
LONG, SHORT = (400, 100), (10, 6)  # (prompt, max_tokens): 32 blocks of 16 tokens, and 1


class Replica:
    """Admission over a pool of `num_blocks`, as service.py uses them: a call admitted to start now takes its blocks
    at once; a held one at its start (or sooner, when `due`), then runs as any other (`started`); each call's
    prompt its own tokens (no prefix shared), so what a call takes is what it gives back."""

    def __init__(self, num_blocks: int, planned: bool = True, policy: AdmissionSettings = REFUSING) -> None:
        self.kv = KvReservations(num_blocks, BLOCK, SLOTS, CONTEXT)
        assert self.kv.planned
        config = AdmissionConfig(SLOTS, 1024, margin_ms=0.0, margin_fraction=0.0)  # every prompt in a step
        self.admission = AdmissionController(flat_cost(1.0), config, policy, kv=self.kv if planned else None)
        self.tables: dict[str, tuple[int, ...]] = {}
        self.held: dict[str, tuple[int, tuple[int, ...], int]] = {}  # key -> (start, prompt, tokens)
        self.failed_allocations = 0  # admitted calls the pool could not take: the service refuses them unreserved
        self.awaited = 0  # held calls whose blocks were not back at their start

    def call(self, key: str, size: tuple[int, int], now_ms: float, budget_ms: int = 10_000, attempt: int = 0):
        prompt = tuple((hash(key) + 7 * i) % 30_000 for i in range(size[0]))
        cached, num_blocks = self.kv.lookup(prompt, size[1], salt=None)
        now_ns = int(now_ms * MS)
        deadline_ns = now_ns + budget_ms * MS
        new = Commitment(key, *size, deadline_ns, attempt=attempt, num_cached_tokens=cached, num_blocks=num_blocks)
        decision = self.admission.decide(new, now_ns)
        if isinstance(decision, Admit) and decision.start_ns is not None:
            self.held[key] = (decision.start_ns, prompt, sum(size))
        elif isinstance(decision, Admit):
            allocation = self.kv.pool.allocate(prompt, sum(size), salt=None)
            if allocation is None:
                self.failed_allocations += 1
                self.admission.release(key)
            else:
                self.tables[key] = allocation.block_ids
        return decision

    def start(self, key: str) -> None:
        _, prompt, num_tokens = self.held.pop(key)
        allocation = self.kv.pool.allocate(prompt, num_tokens, salt=None)
        assert allocation is not None, f"held {key}'s blocks were not back at its start"
        self.tables[key] = allocation.block_ids
        self.admission.started(key)

    def end(self, key: str, now_ns: int) -> None:
        self.kv.pool.free(self.tables.pop(key))
        self.admission.release(key)
        for due in self.admission.due(now_ns):
            self.start(due)

    def advance(self, last_ns: int, now_ns: int) -> None:
        """The device ran as predicted from `last_ns` to `now_ns`: calls progressed and ended as predicted, and held
        calls started at their starts, each event in its turn."""
        admission = self.admission
        while True:
            running = [c for c in admission.commitments.values() if c.reserved_from_ns is None]
            finishes = admission.predictor.finish_times(running, last_ns)
            at_ns = min([*finishes.values(), *(start for start, _, _ in self.held.values()), now_ns])
            moved = {c.key: c for c in progressed(running, finishes, last_ns, at_ns)}
            for c in running:
                if c.key in moved:
                    admission.on_progress(c.key, moved[c.key].num_generated)
                else:
                    self.end(c.key, at_ns)
            for key in [k for k, (start, _, _) in self.held.items() if start <= at_ns]:
                self.start(key)
            last_ns = at_ns
            if at_ns >= now_ns:
                return


def test_a_call_refused_for_blocks_has_them_reserved_for_its_retry():
    replica = Replica(48)  # one and a half long calls; four slots of the full context would need 128
    assert isinstance(replica.call("long-1", LONG, 0), Admit)
    second = replica.call("long-2", LONG, 0)
    assert isinstance(second, Reject) and second.reason == RefusalCause.KV_BLOCKS and second.reserved
    # a short call fits beside them: the 16 blocks long-1 leaves free until its end, which long-2 takes then
    assert isinstance(replica.call("short", SHORT, 0), Admit)
    # a third long call is hinted past long-2's reserved run, not to the same blocks
    third = replica.call("long-3", LONG, 0)
    assert isinstance(third, Reject) and third.reason == RefusalCause.KV_BLOCKS
    assert third.retry_after_ms >= second.retry_after_ms + 100
    # long-1 ends at long-2's hint: its blocks are free, the slots are free, and a stranger is still refused
    at_ms = second.retry_after_ms
    replica.end("short", at_ms * MS)
    replica.end("long-1", at_ms * MS)
    stranger = replica.call("stranger", LONG, at_ms)
    assert isinstance(stranger, Reject) and stranger.reason == RefusalCause.KV_BLOCKS
    assert isinstance(replica.call("long-2", LONG, at_ms, attempt=1), Admit)
    assert replica.failed_allocations == 0 and replica.admission.events["taken"] == 1


def test_by_default_a_call_whose_blocks_free_in_its_slack_is_held_for_them():
    replica = Replica(48, policy=DEFAULT_SETTINGS)
    assert isinstance(replica.call("long-1", LONG, 0), Admit)
    second = replica.call("long-2", LONG, 0)
    assert isinstance(second, Admit) and second.start_ns is not None, "held for long-1's blocks, not refused"
    assert "long-2" not in replica.tables and replica.admission.events["held_for_blocks"] == 1  # taken at its start
    # a third is held too, past long-2's run: the blocks planned for long-2 are not its
    third = replica.call("long-3", LONG, 0)
    assert isinstance(third, Admit) and third.start_ns >= second.predicted_finish_ns
    replica.advance(0, second.start_ns)  # long-1 ends as predicted; long-2 starts with its blocks
    assert "long-1" not in replica.tables and "long-2" in replica.tables and replica.failed_allocations == 0


def test_without_planning_the_pool_refuses_what_admission_admitted():
    """The same second call, with the pool unknown to admission: admitted by the slots, then refused by the pool,
    with no reservation (as before blocks were planned)."""
    replica = Replica(48, planned=False)
    assert isinstance(replica.call("long-1", LONG, 0), Admit)
    assert isinstance(replica.call("long-2", LONG, 0), Admit)
    assert replica.failed_allocations == 1


@pytest.mark.parametrize("policy", [REFUSING, DEFAULT_SETTINGS, AdmissionSettings(hold_in_slack=True)])
@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([LONG, SHORT, (200, 40), (64, 16)]), st.integers(200, 3000), st.integers(0, 60)),
        min_size=1,
        max_size=25,
    ),
    st.integers(34, 100),
)
def test_an_admitted_call_always_finds_its_blocks_on_a_device_that_runs_as_predicted(policy, arrivals, num_blocks):
    """Whatever comes, in whatever order: every admitted call's blocks are free when it is admitted (held for a later
    start or not), and every retry that comes at its hint for a reservation is admitted, or told that no time inside
    its budget works any more (refusals.py `Promises.refuse`: a moved start must still leave a retry's spare)."""
    replica = Replica(num_blocks, policy=policy)
    now, last = 0, 0
    retries: list[tuple[int, str, tuple[int, int], int]] = []  # (hinted time, key, size, deadline in ms)
    for i, (size, budget_ms, gap_ms) in enumerate([*arrivals, (None, 0, 10_000)]):  # the last: retries only
        now += gap_ms * MS
        for at_ns, key, retry_size, deadline_ms in sorted(r for r in retries if r[0] <= now):
            replica.advance(last, at_ns)
            last = at_ns
            decision = replica.call(key, retry_size, at_ns / MS, deadline_ms - at_ns // MS, attempt=1)
            # admitted (at once, or held for the next start inside its budget), or, where that start has moved past
            # the spare a retry is promised with, told that no time inside its budget works: never sent away with a
            # second hint, and never refused by the pool after admission said yes
            kept = isinstance(decision, Admit) or not decision.within_budget
            assert kept, f"{key}'s reserved retry at {at_ns / MS} ms was refused with another hint"
        retries = [r for r in retries if r[0] > now]
        if size is None:
            break
        replica.advance(last, now)
        last = now
        decision = replica.call(f"c{i}", size, now / MS, budget_ms)
        if isinstance(decision, Reject) and decision.reserved:
            retries.append((now + decision.retry_after_ms * MS, f"c{i}", size, now // MS + budget_ms))
        assert replica.failed_allocations == 0
        assert sum(len(t) for t in replica.tables.values()) + replica.kv.num_free == num_blocks
    assert not retries
