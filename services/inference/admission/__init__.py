"""Deadline admission at arrival: the decisions (decisions.py), the prediction (predictor.py) over the step-time
cost model (services/inference/cost/), the controller that admits or refuses with a retry hint (controller.py), the FIFO
baseline (fifo.py), the lateness tracker (lateness.py), and what decides whether a refusal invites a retry: the
replica's saturation (saturation.py) and each tenant's record of coming back (follow.py); and each tenant's fair
share of the slots (shares.py) and class priority (priorities.py), kept as headroom (headroom.py) in proportion
to what each offers (offered.py); what a prediction from a later time sees (plan.py). Runs on the server's event
loop. It may import the standard library and its own modules only: no torch, nothing of the engine or the device.

The controller and its decisions are re-exported here, so callers write `from services.inference.admission
import AdmissionController, Admit`.
"""

from .controller import AdmissionController
from .decisions import (
    DEADLINE,
    DELAYS_ADMITTED,
    NS_PER_MS,
    OVER_SHARE,
    PRIORITY,
    SLOTS_FULL,
    STEP_BUDGET,
    AdmissionConfig,
    Admit,
    Commitment,
    Decision,
    Infeasible,
    Reject,
)
from .plan import progressed
from .predictor import Predictor, peak_occupancy

__all__ = [
    "DEADLINE",
    "DELAYS_ADMITTED",
    "NS_PER_MS",
    "OVER_SHARE",
    "PRIORITY",
    "SLOTS_FULL",
    "STEP_BUDGET",
    "AdmissionConfig",
    "AdmissionController",
    "Admit",
    "Commitment",
    "Decision",
    "Infeasible",
    "Predictor",
    "Reject",
    "peak_occupancy",
    "progressed",
]
