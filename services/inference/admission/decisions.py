"""What admission decides about a call: its commitment (an admitted call or a reserved retry), the config, the
three decisions (admit, reject with a retry hint, infeasible) and why a call is refused (RefusalCause). Plain
data; no torch."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

NS_PER_MS = 1_000_000


@dataclass(slots=True)
class Commitment:
    key: str  # the tenant-scoped admission key (call.py `admission_key`): a retry finds its reservation by it
    num_prompt_tokens: int
    max_tokens: int
    deadline_ns: int
    num_generated: int = 0
    tenant: str = ""
    attempt: int = 0  # the client's count of earlier attempts (x-retry-attempt); 0 when it says none
    priority: int = 0  # its class's priority, 0..100: higher is admitted first under overload
    # A reservation holds a KV slot for a rejected call's hinted retry, over [from, until); it lapses at
    # `expires` if the retry has not come. A held call (`held`) is an admitted call whose slot is reserved the same
    # way, from a start inside its slack, until its engine request begins (then the window is cleared); it never
    # lapses, being admitted.
    reserved_from_ns: int | None = None
    reserved_until_ns: int | None = None
    expires_ns: int | None = None
    again: bool = False  # the reservation is for a call refused on a retry: its rate of return is its own
    held: bool = False
    # its row costs more than the calibrated step's every step, on the host (the cost model's host_us): its
    # grammar's mask (structured output), its log-probabilities
    masked: bool = False
    logprobs: bool = False
    # leading prompt tokens the prefix cache holds for it, pinned when it is admitted: never prefilled, though its
    # attention still reads them (the context is the whole prompt)
    num_cached_tokens: int = 0
    # the paged KV cache's blocks it takes from the pool for its whole run (its prompt and max_tokens, less the cached
    # prefix other calls already hold), where admission plans the pool (`AdmissionController.kv`); else 0
    num_blocks: int = 0
    # when it may first join a step (engine clock): its admission, or its held start; a step that began before
    # then does not hold its prompt (AdmissionController.step_ended)
    admitted_ns: int = 0

    @property
    def is_reservation(self) -> bool:
        """A refused call's reserved retry (not an admitted call, held or not)."""
        return self.reserved_from_ns is not None and not self.held

    @property
    def is_waiting(self) -> bool:
        """An admitted call held for a later start that has not begun yet: it holds its reserved window."""
        return self.held and self.reserved_from_ns is not None

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_cached_tokens if self.num_generated == 0 else 0

    @property
    def num_remaining_tokens(self) -> int:
        return max(self.max_tokens - self.num_generated, 0)

    @property
    def final_context(self) -> int:
        return self.num_prompt_tokens + self.max_tokens


@dataclass(frozen=True)
class AdmissionConfig:
    num_slots: int
    max_num_batched_tokens: int
    margin_ms: float = 20.0  # fixed part of the safety margin
    margin_fraction: float = 0.05  # proportional part, of the budget
    pace_tokens: int = 0  # paced steps: each lasts as long as with this many more prompt tokens

    def margin_ns(self, budget_ns: int) -> int:
        return int(self.margin_ms * NS_PER_MS + self.margin_fraction * budget_ns)

    def min_budget_ns(self, work_ns: int) -> int:
        """The smallest budget B with work + margin(B) <= B."""
        return math.ceil((work_ns + self.margin_ms * NS_PER_MS) / (1 - self.margin_fraction))


@dataclass(frozen=True)
class Admit:
    predicted_finish_ns: int
    # held inside its slack: the start the replica reserved for it (engine clock), a slot predicted to free then;
    # None: it joins the very next step
    start_ns: int | None = None


class RefusalCause(enum.StrEnum):
    """Why a call is not admitted. The first six are admission's (Reject.reason), and KV_BLOCKS where it plans
    the pool; the refusal's message, its ErrorInfo `cause`, the zeroqueue_refusals_total{cause} label and the logs
    say the same string."""

    SLOTS_FULL = "slots_full"  # every slot is taken (running calls, reserved retries) at some point of its run
    STEP_BUDGET = "step_budget"  # a slot is free, but the next steps' token budget is taken by prompts ahead
    DEADLINE = "deadline"  # its own predicted finish is past its deadline less the margin
    DELAYS_ADMITTED = "delays_admitted"  # it would push an admitted call past a deadline it was predicted to meet
    OVER_SHARE = "over_share"  # its tenant holds its fair share or more, and the free slot is kept for another
    PRIORITY = "priority"  # what is free is headroom kept for a higher-priority class that is active
    # not a Reject's: an Infeasible decision, and the tenant's quota checked before admission (quotas.py)
    INFEASIBLE = "infeasible"  # no idle replica could finish it inside its budget
    QUOTA = "quota"  # its tenant is at one of its caps
    COMPILES = "compiles"  # too many new response_format grammars are compiling on the replica (compiler.py)
    # the KV pool lacks its blocks until running calls end: admission's (with a reservation) where it plans the
    # pool (a pool smaller than the slots could fill), else the pool's own check of an admitted call (kv_pool.py)
    KV_BLOCKS = "kv_blocks"


@dataclass(frozen=True)
class Reject:
    retry_after_ms: int
    predicted_finish_ns: int
    within_budget: bool = True  # False: no time inside this call's own budget works; the hint is when
    # the replica frees up, for a call with a fresh budget
    reason: RefusalCause = RefusalCause.DEADLINE  # why not now: one of admission's six
    reserved: bool = False  # a slot is reserved for a retry at the hint (STEP_BUDGET: its turn is held);
    # False: a best guess, every reservation was taken
    saturated: bool = False  # the replica has been refusing most new calls: no retry is invited here (within_budget
    # is False), the hint says when a slot frees, for another replica's sake
    elsewhere: bool = False  # other replicas serve the same model (AdmissionSettings.elsewhere): "try another one"
    # is advice only then


@dataclass(frozen=True)
class Infeasible:
    min_budget_ms: int


Decision = Admit | Reject | Infeasible
