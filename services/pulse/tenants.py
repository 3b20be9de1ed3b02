"""The tenants of a multi-tenant pulse: who sends what. Each tenant is its own open-loop arrival process (its own
seed), through its own API key, so the replica sees, admits and bills them apart.

    --tenant name=A,load=4x,class=batch              # 4x the capacity in --capacity-json
    --tenant name=B,qps=6.5,key=KEY_B,deadline-ms=1500,seed=7

Fields (comma-separated name=value; values hold no commas):
  name         required; the ledger's tenant name, which the replica's metrics label (a replica the tool starts
               gets a tenant of this name)
  key          the tenant's API key; needed with --endpoint, created in a replica the tool starts
  qps | load   one of them: the tenant's rate in req/s, or a multiple of the capacity in --capacity-json (4 or 4x)
  class        GenerateRequest.service_class (default: none named, the replica picks by the budget)
  deadline-ms  the calls' budget (default: --deadline-ms)
  seed         the schedule's seed (default: --seed + the tenant's position, so no two tenants share one)
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

FIELDS = ("name", "key", "qps", "load", "class", "deadline-ms", "seed")


@dataclass(frozen=True)
class TenantSpec:
    name: str
    qps: float | None = None
    load: float | None = None  # a multiple of the capacity
    api_key: str | None = None
    service_class: str = ""
    deadline_ms: float | None = None
    seed: int | None = None

    def rate_qps(self, capacity_qps: float | None) -> float:
        if self.qps is not None:
            return self.qps
        if capacity_qps is None:
            raise ValueError(f"tenant {self.name}: load={self.load:g} needs --capacity-json (written by --capacity)")
        return self.load * capacity_qps

    def seed_or(self, default: int) -> int:
        return self.seed if self.seed is not None else default

    def describe(self, capacity_qps: float | None) -> str:
        """For titles and JSON: never the key."""
        rate = f"{self.rate_qps(capacity_qps):.2f} req/s" + (f" ({self.load:g}x)" if self.load is not None else "")
        return f"{self.name}: {rate}" + (f", class {self.service_class}" if self.service_class else "")


def _number(field: str, text: str, kind=float):
    try:
        value = kind(text.removesuffix("x") if field == "load" else text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"field {field}: not a number: {text!r}") from None
    if not math.isfinite(value) or (field != "seed" and value <= 0):
        raise argparse.ArgumentTypeError(f"field {field}: must be a number > 0, got {text!r}")
    return value


def parse_tenant(text: str) -> TenantSpec:
    """One --tenant value. Errors name the field at fault (argparse prints them after 'argument --tenant:')."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        field, sep, value = part.partition("=")
        field = field.strip()
        if not sep:
            raise argparse.ArgumentTypeError(f"field {field or part!r}: expected name=value in {text!r}")
        if field not in FIELDS:
            raise argparse.ArgumentTypeError(f"field {field!r}: unknown (known: {', '.join(FIELDS)})")
        if field in fields:
            raise argparse.ArgumentTypeError(f"field {field}: given twice")
        fields[field] = value.strip()
    if not fields.get("name"):
        raise argparse.ArgumentTypeError(f"field name: required in {text!r}")
    if ("qps" in fields) == ("load" in fields):
        raise argparse.ArgumentTypeError(f"field qps or load: give exactly one, for tenant {fields['name']}")
    if "key" in fields and not fields["key"]:
        raise argparse.ArgumentTypeError("field key: empty")
    return TenantSpec(
        name=fields["name"],
        qps=_number("qps", fields["qps"]) if "qps" in fields else None,
        load=_number("load", fields["load"]) if "load" in fields else None,
        api_key=fields.get("key"),
        service_class=fields.get("class", ""),
        deadline_ms=_number("deadline-ms", fields["deadline-ms"]) if "deadline-ms" in fields else None,
        seed=_number("seed", fields["seed"], int) if "seed" in fields else None,
    )


def check_tenants(specs: Sequence[TenantSpec], alone: Sequence[str], with_endpoints: bool) -> None:
    """What one --tenant cannot say on its own: distinct names, --alone naming one, keys where none can be made."""
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--tenant: names must differ, got {', '.join(names)}")
    unknown = [name for name in alone if name not in names]
    if unknown:
        raise ValueError(f"--alone {unknown[0]}: no --tenant has that name (tenants: {', '.join(names)})")
    keyless = [spec.name for spec in specs if not spec.api_key]
    if with_endpoints and keyless:
        raise ValueError(
            f"--tenant {keyless[0]}: field key is needed with --endpoint (tenants are made only in started replicas)"
        )
    keys = [spec.api_key for spec in specs if spec.api_key]
    if len(set(keys)) != len(keys):
        raise ValueError("--tenant: two tenants share a key, so the replica would see them as one")
