"""Retries the replica invites must raise goodput, never lower it: judged on a virtual device that runs exactly
as calibrated (steady_device.py), with Poisson arrivals of the SmolLM2-135M shape (64 + 32 tokens, 2-s
deadlines) at and past capacity. No torch, no clock: the same calls every run."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from services import errors
from services.inference.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionSettings,
    Admit,
    Commitment,
    Reject,
)
from services.inference.admission.history import Saturation
from services.inference.cost.model import CostModel
from services.inference.metrics import ServiceMetrics
from tests.inference.steady_device import run

# this machine's calibration of the SmolLM2-135M shape (µs by rows), 32 slots, 256 tokens a step
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
ROW_US = [8519.0, 9380.2, 10413.9, 12375.3, 18219.6, 29966.7, 40262.7, 73194.9, 145998.6]
CAPACITY_PER_S = 17  # what this device finishes at saturation (see the no-retry runs below)


def replica(
    max_reservations: int | None = None, hold: bool = False, elsewhere: bool = True, prompts: bool = True
) -> AdmissionController:
    """The SmolLM2-135M shape's replica; `hold`: calls that fit later inside their slack are held (`zeroqueue
    serve --hold`), else refused with a reserved retry (the default); `elsewhere`: other replicas serve the same
    model (`zeroqueue serve --elsewhere`), so a saturated one invites no retry to itself, the verdict these tests
    judge (test_elsewhere.py judges a replica alone, `serve`'s default); `prompts`: a prompt that waits a few steps
    for the step budget is admitted behind those ahead (the default), else refused with a held turn
    (`--no-hold-prompts`)."""
    cost = CostModel(list(ROWS), list(ROW_US), 1.975)
    settings = AdmissionSettings(
        max_reservations=max_reservations, hold_in_slack=hold, elsewhere=elsewhere, hold_for_prompts=prompts
    )
    return AdmissionController(cost, AdmissionConfig(32, 256), settings)


def goodput(controller: AdmissionController, rate: float, attempts: int, seed: int) -> tuple[float, int, int]:
    """Calls finished in deadline per second; admitted calls that missed; admitted calls."""
    tally = run(controller, rate, 30.0, seed=seed, max_attempts=attempts)
    return tally.goodput(30.0), len(tally.misses), tally.num_admitted


@pytest.mark.parametrize("load", [1.0, 2.0, 4.0])
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("elsewhere", [True, False])
def test_retries_that_honour_the_hint_cost_no_goodput(load, seed, elsewhere):
    """With others beside it, a saturated replica invites no retry; alone, only those that leave room to spare
    (`saturated_retry_slack_runs`)."""
    rate = load * CAPACITY_PER_S
    no_retries, _, _ = goodput(replica(elsewhere=elsewhere), rate, 1, seed)
    for attempts in (2, 8):
        with_retries, misses, admitted = goodput(replica(elsewhere=elsewhere), rate, attempts, seed)
        # within 2 %: at saturation a retry can only take another call's place, so the two are equal but for the
        # moments the verdict changes
        assert with_retries >= 0.98 * no_retries, (load, attempts, with_retries, no_retries)
        assert misses <= 0.005 * admitted


def test_before_saturation_retries_raise_goodput_and_find_their_slots():
    """Without holds, a refused call's retry at the hint finds the slot reserved for it (with holds, the same
    call is held for that slot instead: test_hold.py), or the turn held for its prompt (`--no-hold-prompts`; by
    default the prompt is admitted behind those ahead instead, and far fewer calls are refused at all)."""
    rate = 0.9 * CAPACITY_PER_S
    kept = broken = 0
    for seed in (1, 2, 3):
        no_retries, _, _ = goodput(replica(hold=False, prompts=False), rate, 1, seed)
        controller = replica(hold=False, prompts=False)
        tally = run(controller, rate, 30.0, seed=seed, max_attempts=2)
        assert tally.goodput(30.0) > no_retries
        # a retry that came for its reserved slot, or its held turn, on time
        kept += tally.outcomes["retry_on_time_admit"]
        broken += tally.outcomes["retry_on_time_reject"]
    assert kept >= 60 and broken <= 0.1 * (kept + broken)


def overload_while_saturated(controller: AdmissionController, **run_args) -> tuple:
    """A sustained 4x overload of `controller`'s replica, the SDK retrying up to 8 times: the run's tally, and the
    decisions made while its tenant was saturated."""
    decide, while_saturated = controller.decide, []

    def judged(new, now_ns):
        saturated = controller.promises.saturation("t").saturated
        decision = decide(new, now_ns)
        if saturated:
            while_saturated.append(decision)
        return decision

    controller.decide = judged
    tally = run(controller, 4 * CAPACITY_PER_S, 10.0, seed=1, max_attempts=8, **run_args)
    return tally, while_saturated


@pytest.mark.parametrize("hold", [True, False])
def test_a_saturated_replica_with_others_beside_it_invites_no_retry_and_holds_nothing(hold):
    """A sustained 4x overload of a replica with others beside it (`--elsewhere`): while the verdict stands, no
    refusal invites a retry or reserves for one, and no call is held for a later slot (a held call would take a
    fresher one's place just as a retry would). A replica alone: test_elsewhere.py."""
    controller = replica(hold=hold, elsewhere=True)
    _, while_saturated = overload_while_saturated(controller)
    refusals = [d for d in while_saturated if isinstance(d, Reject)]
    # refused either as saturated or with no time inside the budget at all: never a hint to come back here
    assert len(refusals) > 500 and all(not d.within_budget and not d.reserved for d in refusals)
    assert sum(d.saturated for d in refusals) > 100 and all(d.elsewhere for d in refusals)
    assert not any(isinstance(d, Admit) and d.start_ns is not None for d in while_saturated)
    assert controller.num_reserved == 0 and not controller.turns
    # the run has drained: the verdict went with its cause (issue 35), and the next burst is judged afresh
    assert not controller.saturations["t"].saturated


def replica_call(rid: str, now_ns: int) -> Commitment:
    return Commitment(f"t/{rid}", 64, 32, now_ns + 2_000_000_000, tenant="t")


def test_saturation_needs_a_run_of_refusals_and_clears_with_hysteresis():
    s, now_ns, gap_ns = Saturation(), 0, 50_000_000  # 20 first attempts a second
    for _ in range(5):
        now_ns += gap_ns
        s.observe(True, now_ns)
    assert not s.saturated, "a burst of refusals is no saturation"
    for _ in range(40):
        now_ns += gap_ns
        s.observe(True, now_ns)
    assert s.saturated
    while s.share >= 0.2:
        now_ns += gap_ns
        s.observe(False, now_ns)
    assert s.saturated, "between the two thresholds the verdict stands"
    while s.saturated:
        now_ns += gap_ns
        s.observe(False, now_ns)
    assert s.share < 0.15


def test_a_burst_into_a_full_replica_is_no_saturation():
    s = Saturation()
    for i in range(30):  # 30 refusals within 30 ms: a burst
        s.observe(True, i * 1_000_000)
    assert not s.saturated
    s.observe(True, 600_000_000)  # still refusing most of what comes half a second later: saturated
    assert s.saturated


def test_saturation_is_forgotten_after_a_quiet_spell():
    s = Saturation()
    for i in range(100):
        s.observe(True, i * 50_000_000)
    assert s.saturated
    s.observe(True, 100 * 50_000_000 + 30 * 1_000_000_000)  # 30 s later, one refusal of a burst
    assert not s.saturated, "what was refused half a minute ago says nothing of now"


def test_a_few_refusals_at_a_low_rate_are_no_saturation():
    s = Saturation()
    for i in range(20):  # one call every 2 s, all refused: never 8 recent enough to judge
        s.observe(True, i * 2_000_000_000)
    assert not s.saturated


def test_a_saturated_refusal_says_so_and_tells_grpc_clients_not_to_retry_here():
    err = errors.Overloaded(
        120, 900, 2000, within_budget=True, cause="slots_full", reserved=False, saturated=True, elsewhere=True
    )
    assert not err.within_budget and err.pushback_ms == -1
    assert err.metadata["saturated"] == "true" and err.metadata["retry_within_budget"] == "false"
    assert "try another replica" in str(err) and "120 ms" in str(err)
    plain = errors.Overloaded(120, 900, 2000, cause="slots_full", reserved=True)
    assert plain.metadata["saturated"] == "false" and plain.pushback_ms == 120


@pytest.mark.parametrize("hold", [False, True])
def test_reservation_events_are_exported(hold):
    controller = replica(hold=hold)
    run(controller, CAPACITY_PER_S, 30.0, seed=1, max_attempts=2)
    metrics = ServiceMetrics()
    metrics.watch_reservations(controller.events)
    text = generate_latest(metrics.registry).decode()
    expected = (
        {"held", "held_for_prompts", "held_started_early"}
        if hold
        else {"reserved", "taken", "turn_held", "held_for_prompts"}
    )
    assert expected <= set(controller.events)
    for event, count in controller.events.items():
        assert f'zeroqueue_reservation_events_total{{event="{event}"}} {float(count)}' in text
