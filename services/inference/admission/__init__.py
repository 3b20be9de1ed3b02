"""Admission at arrival, behind one interface (interface.py `Admission`): deadline admission (controller.py
`AdmissionController`) and the FIFO comparator (fifo.py `FifoAdmission`). Runs on the server's event loop.

A deadline decision reads top to bottom in controller.py `_decide`: the checks in their order (checks.py: feasible
at all, headroom kept for others, fits now beside the running calls), then the outcome (refusals.py: admit, or
refuse with or without a promise to the retry). What they decide with: the decisions and their causes
(decisions.py: Commitment, Admit / Reject / Infeasible, RefusalCause), every tuning value (settings.py), and the
estimators (estimators.py builds them): the prediction over the step-time cost model (predictor.py, over
services/inference/cost/); the headroom kept for others (headroom.py: what each sender offers, each tenant's fair
share, each active class's priority); and what admission learns from how calls went (history.py: how late calls
really finish, whether a tenant is saturated, whether its refused calls come back for their reservations).

It may import the standard library, the cost model (services/inference/cost/) and its own modules only: no torch,
nothing of the engine or the device. Callers write `from services.inference.admission import Admission,
AdmissionController, Admit, RefusalCause`.
"""

from .controller import AdmissionController
from .decisions import NS_PER_MS, AdmissionConfig, Admit, Commitment, Decision, Infeasible, RefusalCause, Reject
from .fifo import FifoAdmission
from .interface import Admission
from .predictor import Predictor, peak_occupancy, progressed
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
