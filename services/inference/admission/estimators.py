"""The estimators a decision is judged with, built from the settings (settings.py), shared by the checks
(checks.py) and the outcome (refusals.py): the prediction over the cost model (predictor.py), its idle twin,
how late calls really finish (`Lateness`, history.py), and the tenants' fair share and classes' priority that
headroom is kept for (`Shares`, `Priorities`, headroom.py). No torch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..cost.model import CostModel
from .checks import Arrival
from .decisions import AdmissionConfig, Commitment
from .headroom import NONE, Headroom, Priorities, Senders, Shares, headroom, holding_against
from .history import Lateness
from .predictor import Predictor
from .settings import AdmissionSettings


@dataclass(eq=False)
class Estimators:
    config: AdmissionConfig
    predictor: Predictor
    idle: Predictor  # on the calibration as measured on the idle device: "infeasible" (checks.infeasible)
    lateness: Lateness
    shares: Shares
    priorities: Priorities
    fair: bool = True  # fair share and class priority keep headroom; off: first come, the comparison of old

    @classmethod
    def build(
        cls, cost: CostModel, config: AdmissionConfig, s: AdmissionSettings, weights: Mapping[str, float] | None
    ) -> Estimators:
        max_batch = config.num_slots + s.max_reservations_for(config.num_slots) + 1  # most calls in a prediction
        return cls(
            config,
            Predictor(cost, config, max_batch=max_batch),
            Predictor(_as_calibrated(cost), config, max_batch=2),
            Lateness(s.lateness_alpha, num_deviations=s.lateness_num_deviations),
            Shares(config.num_slots, dict(weights or {}), s.per_tenant_slots, s.per_tenant_prompts, _senders(s)),
            Priorities(s.per_class_slots, config.num_slots // s.class_slots_divisor, s.per_class_prompts, _senders(s)),
            s.fair,
        )

    def headroom(self, call: Arrival) -> Headroom:
        """The headroom `call` must leave for others: none for a retry on time for its reservation, none if not
        fair."""
        if call.on_time or not self.fair:
            return NONE
        return headroom(self.shares, self.priorities, call.new, call.now_ns)

    def holding_against(self, new: Commitment, room: Headroom, reservations: list[Commitment]) -> list[Commitment]:
        """The reservations that hold their slots against `new` (headroom.py); all of them if not fair."""
        return holding_against(new, room, reservations) if self.fair else reservations

    def lent(self, tenant: str, now_ns: int) -> bool:
        """In fair mode, slots of `tenant`'s share are lent to another tenant (`Shares`)."""
        return self.fair and self.shares.lent_to_others(tenant, now_ns)


def _as_calibrated(cost: CostModel) -> CostModel:
    """`cost` as it was measured on the idle device, without the running ratio, which a loaded or slowed replica
    inflates."""
    return CostModel(
        list(cost.rows),
        list(cost.row_us),
        cost.us_per_context_token,
        num_deviations=cost.num_deviations,
        deviation=cost.deviation,
    )


def _senders(s: AdmissionSettings) -> Senders:
    return Senders(s.active_half_life_s, s.offered_half_life_s, s.active_weight, s.hold_alpha)
