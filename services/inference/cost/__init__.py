"""The step-time cost model (model.py: `CostModel`, calibrated on this machine and corrected online, and
`fit_context_cost`): what the engine calibrates and paces with, its watchdog judges speed by, and admission
predicts with. A room of its own so that both the engine and admission may import it without importing each
other. It imports the standard library only: no torch, nothing else of the service.
"""

from .model import CostModel, fit_context_cost

__all__ = ["CostModel", "fit_context_cost"]
