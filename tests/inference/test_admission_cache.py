"""Admission predicts with the prefix cache: a call's cached prompt tokens are never prefilled, so its predicted
finish is earlier, a budget only the cache makes feasible is admitted (refused as infeasible without it), and the
calls beside it are predicted with its smaller prefill too."""

from __future__ import annotations

from services.inference.admission import AdmissionConfig, AdmissionController, Admit, Commitment, Infeasible
from services.inference.cost.model import CostModel
from tests.inference.test_admission import MS, REFUSING, controller


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
