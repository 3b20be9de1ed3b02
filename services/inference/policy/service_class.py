"""The class of service of a call (billing/policy.py ClassSpec), in domain terms: the name a request asked for
(checked for its size and characters by generate_request.py) and the call's budget give its class, or the
INVALID_ARGUMENT that names why not. A call that names no class gets the least privileged class that accepts
its budget (ServingPolicy.class_for)."""

from __future__ import annotations

from billing.policy import ClassSpec, ServingPolicy
from services import errors
from services.errors import clip

from ..call import BudgetSource

MAX_LISTED = 8  # classes a refusal lists with their ranges; one more says how many were left out


def _ranges(policy: ServingPolicy) -> str:
    listed = [f"{c.name} ({c.min_budget_ms}-{c.max_budget_ms} ms)" for c in policy.classes[:MAX_LISTED]]
    more = len(policy.classes) - MAX_LISTED
    return ", ".join(listed) + (f" and {more} more" if more > 0 else "")


def _budget_said(budget_ms: int, source: BudgetSource) -> str:
    if source is BudgetSource.SERVER_DEFAULT:
        return f"{budget_ms} ms (the server's default: the call set no deadline)"
    return f"{budget_ms} ms (its deadline)"


def class_of(policy: ServingPolicy, requested: str, budget_ms: int, source: BudgetSource) -> ClassSpec:
    """The call's class: the one it names if that accepts `budget_ms`, else the one the budget gives; raises
    errors.ServiceClassRefused naming service_class (or deadline, when no class is named)."""
    if requested:
        spec = policy.class_named(requested)
        if spec is None:
            raise errors.ServiceClassRefused(
                "service_class",
                f"unknown class {clip(requested)!r}; this replica offers {_ranges(policy)}",
                "UNKNOWN_SERVICE_CLASS",
                {"service_class": clip(requested)},
            )
        if not spec.accepts(budget_ms):
            raise errors.ServiceClassRefused(
                "service_class",
                f"class {spec.name!r} accepts budgets of {spec.min_budget_ms} to {spec.max_budget_ms} ms; this "
                f"call's budget is {_budget_said(budget_ms, source)}",
                "BUDGET_OUTSIDE_CLASS",
                {
                    "service_class": spec.name,
                    "min_budget_ms": str(spec.min_budget_ms),
                    "max_budget_ms": str(spec.max_budget_ms),
                    "budget_ms": str(budget_ms),
                },
            )
        return spec
    spec = policy.class_for(budget_ms)
    if spec is None:
        raise errors.ServiceClassRefused(
            "deadline",
            f"no class of service accepts a budget of {_budget_said(budget_ms, source)}; the classes: "
            f"{_ranges(policy)}",
            "NO_CLASS_FOR_BUDGET",
            {"budget_ms": str(budget_ms)},
        )
    return spec
