"""Admission at arrival, behind one interface (interface.py `Admission`): deadline admission (controller.py
`AdmissionController`) and the FIFO comparator (fifo.py `FifoAdmission`). Runs on the server's event loop.

A deadline decision reads top to bottom in controller.py `_decide`: the checks in their order (checks.py: feasible
at all, headroom kept for others, fits now beside the running calls), then the outcome (refusals.py: admit, or
refuse with or without a promise to the retry). What they decide with: the decisions and their causes
(decisions.py: Commitment, Admit / Reject / Infeasible, RefusalCause), every tuning value (settings.py), and the
estimators (estimators.py builds them): the prediction (predictor.py) over the step-time cost model
(services/inference/cost/), and what a prediction from a later time sees (plan.py); how late calls really finish
(lateness.py); each tenant's fair share (shares.py) and each class's priority (priorities.py), kept as headroom
(headroom.py) in proportion to what each offers (offered.py); the replica's saturation (saturation.py) and each
tenant's record of coming back for its reservations (follow.py).

It may import the standard library, the cost model (services/inference/cost/) and its own modules only: no torch,
nothing of the engine or the device. Callers write `from services.inference.admission import Admission,
AdmissionController, Admit, RefusalCause`.
"""

from .controller import AdmissionController
from .decisions import NS_PER_MS, AdmissionConfig, Admit, Commitment, Decision, Infeasible, RefusalCause, Reject
from .fifo import FifoAdmission
from .interface import Admission
from .plan import progressed
from .predictor import Predictor, peak_occupancy
from .settings import DEFAULT_SETTINGS, AdmissionSettings

__all__ = [
    "DEFAULT_SETTINGS",
    "NS_PER_MS",
    "Admission",
    "AdmissionConfig",
    "AdmissionController",
    "AdmissionSettings",
    "Admit",
    "Commitment",
    "Decision",
    "FifoAdmission",
    "Infeasible",
    "Predictor",
    "RefusalCause",
    "Reject",
    "peak_occupancy",
    "progressed",
]
