"""Admission predicts with the prefix cache: a call's cached prompt tokens are never prefilled, so its predicted
finish is earlier, a budget only the cache makes feasible is admitted (refused as infeasible without it), and the
calls beside it are predicted with its smaller prefill too. At twice its capacity, calls sharing a 1k-token prefix
meet their deadlines (at least 99.9 % of those admitted) on a device that runs as calibrated, and the cache lets it
admit many times the calls it admits without."""

from __future__ import annotations

import pytest

from services.inference.admission import AdmissionConfig, AdmissionController, Admit, Commitment, Infeasible
from services.inference.cost.model import CostModel
from tests.inference.steady_device import run
from tests.inference.test_admission import MS, REFUSING, controller
from tests.inference.test_retry_invitations import replica


def prompt_call(key: str, cached: int, deadline_ms: int) -> Commitment:
    # 1,000 prompt tokens, 10 new: 4 chunks of at most 256 prompt tokens without the cache (3 steps before the first
    # token's), 1 with 960 of them cached
    return Commitment(key, 1000, 10, deadline_ms * MS, num_cached_tokens=cached)


def test_a_budget_only_the_cache_makes_feasible_is_admitted():
    without, with_cache = controller(), controller()
    assert without.decide(prompt_call("a", cached=0, deadline_ms=110), 0) == Infeasible(min_budget_ms=130)
    decision = with_cache.decide(prompt_call("a", cached=960, deadline_ms=110), 0)
    assert isinstance(decision, Admit) and decision.predicted_finish_ns == 100 * MS


def test_the_prefill_saved_is_predicted_for_the_call_and_its_neighbours():
    # each prompt token costs 10 µs of its step: the cache takes 960 tokens (9.6 ms) out of the prefill step
    cost = CostModel(rows=[1, 1001], row_us=[1000, 11000], us_per_context_token=0.0, num_deviations=0.0, deviation=0.0)
    finishes = {}
    for cached in (0, 960):
        c = AdmissionController(cost, AdmissionConfig(4, 2048, margin_ms=0.0, margin_fraction=0.0), REFUSING)
        first = c.decide(Commitment("a", 1000, 10, 10_000 * MS, num_cached_tokens=cached), 0)
        beside = c.decide(Commitment("b", 8, 10, 10_000 * MS), 0)
        assert isinstance(first, Admit) and isinstance(beside, Admit)
        finishes[cached] = (first.predicted_finish_ns, beside.predicted_finish_ns)
    saved_ns = 960 * 10_000  # 960 rows at 10 µs
    assert finishes[0][0] - finishes[960][0] == saved_ns
    assert finishes[0][1] - finishes[960][1] == saved_ns


def test_a_prefill_after_a_cached_prefix_is_charged_the_prefix_it_reads():
    """Calibrated: each prefilled row reads the cached prefix, and a later chunk the chunks before it."""
    finishes = {}
    for per_read_us in (0.0, 0.01):
        cost = CostModel(
            rows=[1, 1001],
            row_us=[1000, 11000],
            us_per_context_token=0.0,
            us_per_prefill_context_token=per_read_us,
            num_deviations=0.0,
            deviation=0.0,
        )
        c = AdmissionController(cost, AdmissionConfig(4, 256, margin_ms=0.0, margin_fraction=0.0), REFUSING)
        hit = c.decide(Commitment("hit", 1000, 10, 10_000 * MS, num_cached_tokens=480), 0)
        assert isinstance(hit, Admit)
        finishes[per_read_us] = hit.predicted_finish_ns
    # 520 rows read the 480 cached; in chunks of 256 the second (256 rows) reads the first 256, the third (8) 512
    reads = 520 * 480 + 256 * 256 + 8 * 512
    assert finishes[0.01] - finishes[0.0] == round(reads * 0.01 * 1000)


# The SmolLM2-135M shape's calibration on a 2-core host (test_retry_invitations.py), 32 slots, 256 tokens a step;
# calls of a RAG service: a 1,017-token prompt whose first 1,008 tokens (63 blocks) are a shared document, 16 new.
PROMPT, CACHED, NEW = 1017, 1008, 16


@pytest.mark.parametrize("seed", [1, 2])
def test_a_shared_1k_prefix_at_twice_capacity_meets_its_deadlines_and_the_cache_admits_more(seed):
    """On a virtual device that runs as calibrated and never runs the cached prompt tokens (steady_device.py)."""
    saturated = run(replica(), 200, 20.0, seed=seed, **rag(2000), max_attempts=1)
    capacity_per_s = saturated.goodput(20.0)  # what it finishes at saturation: about 54 calls a second
    cached = run(replica(), 2 * capacity_per_s, 30.0, seed=seed, **rag(2000), max_attempts=1)
    cold = run(replica(), 2 * capacity_per_s, 30.0, seed=seed, **rag(2000, cached=0), max_attempts=1)
    sent = sum(cached.outcomes.values())
    assert cached.num_admitted > 0.4 * sent and len(cached.misses) <= 0.001 * cached.num_admitted
    assert cached.num_admitted > 10 * cold.num_admitted and len(cold.misses) <= 0.001 * cold.num_admitted


def test_budgets_only_the_cache_makes_feasible_are_admitted_under_load_and_refused_as_infeasible_without_it():
    # 500 ms: a cold 1k-token prefill alone takes longer on this device; a hit prefills 9 tokens
    cached = run(replica(), 20, 10.0, seed=3, **rag(500), max_attempts=1)
    cold = run(replica(), 20, 10.0, seed=3, **rag(500, cached=0), max_attempts=1)
    assert cold.outcomes == {"first_infeasible": sum(cold.outcomes.values())}
    # with it none is infeasible; a burst of the Poisson arrivals may still be refused for load
    assert cached.outcomes["first_infeasible"] == 0 and not cached.misses
    assert cached.outcomes["first_admit"] >= 0.95 * sum(cached.outcomes.values())


def rag(budget_ms: int, cached: int = CACHED) -> dict:
    return dict(prompt_tokens=PROMPT, max_tokens=NEW, budget_ms=budget_ms, cached_tokens=cached)
