"""Every tuning value of deadline admission, in one place, each with its unit in its name and why it is what it
is. The replica's own part (its slots, the step's token budget, pacing and the operator's safety margin) is
AdmissionConfig (decisions.py): it comes from the engine and the serve flags, and every prediction reads it.
These are the decision's: how long promises to refused calls are kept, how much headroom is kept for whom, and
the rates the estimators learn at. No torch; nothing but the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    # -- promises to refused calls (controller.py, refusals.py)
    # a refused call's reservation (or turn) waits this long past its hinted time: a client's retry timer and the
    # network add a few ms, and a reservation that lapses a moment early wastes the slot it held
    reservation_grace_ms: float = 50.0
    # a retry on time whose slot (or step room) is still taken, because the device ran slower than predicted, is
    # admitted if that frees within this: it joins when the slot frees rather than being sent away again (a slot
    # that frees later still, inside its budget, is held for it: refusals.py `Promises.refuse`)
    retry_hold_ms: float = 50.0
    # a rejection storm must not grow the work of every decision: at most this many reservations (None: one per
    # slot, the most that can be taken up at once)
    max_reservations: int | None = None
    # retry times tried per refusal, each a prediction: the first few times a slot frees are where a retry fits,
    # and more would grow the cost of a refusal, the common decision under overload
    max_retry_candidates: int = 8
    # a retry is invited only to a time from which its predicted run leaves at least this many runs again spare in
    # its budget: a call admitted with less holds back the prompts of every call admitted after it (each one that
    # joins lengthens its run), so near capacity it costs more goodput than it brings
    retry_slack_runs: float = 1.0
    # a call that cannot start now but would finish in time from a slot that frees inside its slack is admitted
    # and held for that slot, rather than refused with a reservation for a retry: the slot is the same, but a
    # held call needs no second round trip, and its start never lapses because a client did not come back. The
    # wait is bounded by the call's own deadline (its start must leave `retry_slack_runs` of its run spare), never
    # by a count of calls, and every held call is planned in the calendar like a running one. Off by default: on
    # a real replica of the bundled model it delivered 0.90-0.98x a FIFO queue's goodput at capacity where
    # refusing with a reserved retry delivered 1.00-1.06x (BENCHMARKS.md, "Holding calls in their slack")
    hold_in_slack: bool = False
    # a held call's predicted run from its start must leave this many runs again spare in its budget, whoever
    # lent it slots: its start is planned without the calls that will join beside it before then. 0.5 sufficed
    # while prompts were priced at the marginal row, which overpriced them on the virtual replica's calibration;
    # priced by their chunks (as the device runs them), the flood beside a modest tenant at 4x let 6 admitted calls
    # miss with 0.5 and 0.75, none with 1 (test_hold.py)
    hold_slack_runs: float = 1.0
    # a call that fits beside the running calls but whose prompt must wait a few steps for room in the step's token
    # budget (a burst's prompts start a few per step) is admitted now, its prefill behind those ahead of it, if its
    # run from then leaves hold_slack_runs spare, rather than refused for the step budget with a held turn. The wait
    # is a few steps, bounded by the call's own deadline, and the engine's scheduler chunks prompts in arrival
    # order anyway. On by default since its wait is priced as the device runs it (refusals.py `_prompt_wait`): on
    # the virtual replica, bursts from clients that never retry went from 4 calls a burst to all the slots hold
    # (a FIFO queue's 12 of 12 at 0.7x), with no admitted miss (test_burst_prompts.py); BENCHMARKS.md, "A burst's
    # prompts". Off (`serve --no-hold-prompts`): refused with a held turn, the hint a few steps away
    hold_for_prompts: bool = True
    # a call refused only for KV blocks (a pool admission plans: smaller than the slots could fill) whose blocks are
    # free from a start inside its slack is admitted and held for that start, as `hold_in_slack` holds any call:
    # the blocks a long call gives back come only at its end, seconds away, so a refusal there costs the caller a
    # round trip and the board a refusal for a start the replica can already promise. On by default: on the bundled
    # model with 84 blocks for 8 slots it refused 0-16 % of first attempts at 6-14 req/s against refusing's 7-55 %,
    # goodput equal or higher, no admitted miss (BENCHMARKS.md, "KV blocks planned on admission's calendar")
    hold_for_blocks: bool = True
    # tenants whose saturation and follow-through are remembered: bounded, the least recently seen go first
    max_tenants: int = 1024
    # other replicas serve the same model behind the same address or balancer (`zeroqueue serve --elsewhere`): a
    # saturated replica then invites no retry to itself and points it at them. Off by default: a replica alone is
    # its callers' only replica, so saturation never turns a refusal into "go elsewhere" while it can reserve the
    # retry a slot inside the caller's budget; past that it still invites none, saying there is no other to try
    elsewhere: bool = False
    # saturated, a replica alone invites a retry (or holds a turn, or a call) only where its run from then leaves at
    # least this many runs spare in its budget, not retry_slack_runs: there every slot that frees is refilled at once,
    # so runs take longer than predicted, and a retry with less to spare breaks its promise or misses its deadline.
    # The virtual SmolLM2-135M replica at 2-4x capacity, 2-s budgets: with 1 run, a third of those reservations were
    # refused on arrival, 2-3 % of admitted calls missed and goodput fell 7-10 % below a replica that invites none;
    # with 2.5, within 1.5 % of it and as few misses; with 4-6-s budgets, 2-8 % above it (test_elsewhere.py)
    saturated_retry_slack_runs: float = 2.5

    # -- headroom kept for others (headroom.py)
    # fair share between tenants and class priority; off: first come, the comparison of old
    fair: bool = True
    # free slots kept for each modest tenant or tenant under its share: calls come in bursts of a few
    per_tenant_slots: int = 4
    # prompts kept room for in the next step's token budget, for all those tenants: the first of a burst start at once
    per_tenant_prompts: int = 2
    # free slots kept for each active higher class, at most: as for a tenant, a burst of a few
    per_class_slots: int = 4
    # prompts kept room for in the next step's token budget, for all the higher classes together
    per_class_prompts: int = 2
    # all higher classes together keep at most num_slots // this: a replica of few slots is never held for a
    # class that sends one call
    class_slots_divisor: int = 4

    # -- what senders offer (`Senders`, headroom.py): tenants for fair share, classes for priority
    # a sender is active while its age-weighted arrivals, at this half-life, stay over active_weight
    active_half_life_s: float = 2.0
    # of the rate a sender offers: long enough that a Poisson stream reads steady
    offered_half_life_s: float = 8.0
    # age-weighted arrivals under which a sender with nothing running is idle: a quarter of a call
    active_weight: float = 0.25
    # weight of the newest admitted call in a sender's mean slot hold: a few tens of calls make the mean
    hold_alpha: float = 0.05

    # -- saturation (`Saturation` in history.py): no retry invited to a replica refusing most new calls
    # the share of first attempts refused is weighted by age at this half-life: a few seconds of traffic
    saturation_half_life_s: float = 2.0
    # saturated once the refused share stays over this; hysteresis: no longer once it falls under leave
    saturation_enter_share: float = 0.3
    saturation_leave_share: float = 0.15
    # attempts' worth of recent weight before any verdict: a few refusals at a low rate are none
    saturation_min_attempts: float = 8.0
    # how long the share must stay over enter: a burst into a full replica is no verdict
    saturation_hold_s: float = 0.5

    # -- follow-through (`FollowThrough`, history.py): whether refused calls come back for their reservations
    # weight of the newest reservation's fate in a tenant's rate: about the last ten
    follow_alpha: float = 0.1
    # reserve only where at least this share of reservations was taken up: below, a held slot mostly idles
    follow_threshold_share: float = 0.5
    # every this-many-th unbacked refusal reserves anyway, so a tenant whose clients start retrying is seen to
    follow_explore_every: int = 8

    # -- lateness (`Lateness` in history.py): how much later than predicted calls really finish
    # weight of the newest call in the running mean: slots free late for reasons that change over seconds
    lateness_alpha: float = 0.05
    # slots are expected to free this many mean absolute deviations past the mean lateness: the cautious side
    lateness_num_deviations: float = 2.0

    def max_reservations_for(self, num_slots: int) -> int:
        return num_slots if self.max_reservations is None else self.max_reservations


DEFAULT_SETTINGS = AdmissionSettings()
