"""`zeroqueue classes add|update|list` and `zeroqueue tenants policy set|show`: classes of service and tenant
policies (billing/service_classes.py), each command one unit of work on a migrated ledger; wired by cli_billing.py.

Amounts on the command line are exact: --device-hours-per-month 1.5 is 5,400,000,000 unit·µs and
--spend-per-month 12.5 is 12,500,000 micro-units; a value that is not a whole number of µs or micro-units, or not
positive, is refused naming the option.
"""

from __future__ import annotations

import argparse
from decimal import Decimal, InvalidOperation

from services.cli_ledger import ledger_command, ledger_session

CAP_NAMES = {"device": "device_us_per_month", "spend": "spend_micros_per_month", "calls": "calls_per_s"}
US_PER_HOUR = 3_600_000_000
MICROS_PER_UNIT = 1_000_000


def exact_amount(text: str, scale: int, option: str) -> int:
    """``text`` (a decimal) × ``scale`` as a positive integer; InvalidPolicy naming ``option`` otherwise."""
    from billing.errors import InvalidPolicy

    try:
        value = Decimal(text.strip()) * scale
    except InvalidOperation:
        raise InvalidPolicy(f"{option} must be a decimal number, got {text!r}", field=option) from None
    if not value.is_finite() or value != value.to_integral_value() or value <= 0:
        raise InvalidPolicy(f"{option} must be positive and exact to a millionth, got {text!r}", field=option)
    return int(value)


def _caps(args: argparse.Namespace) -> dict[str, int | None]:
    """The caps this command sets (an int) or clears (None); the others stay as they are."""
    from billing.errors import InvalidPolicy

    caps: dict[str, int | None] = {}
    if args.device_hours_per_month is not None:
        caps["device_us_per_month"] = exact_amount(args.device_hours_per_month, US_PER_HOUR, "--device-hours-per-month")
    if args.device_us_per_month is not None:
        caps["device_us_per_month"] = args.device_us_per_month
    if args.spend_per_month is not None:
        caps["spend_micros_per_month"] = exact_amount(args.spend_per_month, MICROS_PER_UNIT, "--spend-per-month")
    if args.spend_micros_per_month is not None:
        caps["spend_micros_per_month"] = args.spend_micros_per_month
    if args.calls_per_s is not None:
        caps["calls_per_s"] = args.calls_per_s
    for name in args.clear:
        cap = CAP_NAMES.get(name, name)
        if cap in caps:
            raise InvalidPolicy(f"--clear: {cap} is both set and cleared", field="clear")
        caps[cap] = None
    return caps


def _print_policy(view) -> None:  # type: ignore[no-untyped-def]
    print(f"tenant\t{view.tenant}")
    print(f"weight\t{view.weight}")
    for cap in CAP_NAMES.values():
        value = getattr(view, cap)
        print(f"{cap}\t{'none' if value is None else value}")


def run_policy_set(args: argparse.Namespace) -> int:
    from billing.service_classes import set_tenant_policy

    caps = _caps(args)
    with ledger_session(args) as session:
        view = set_tenant_policy(session, args.tenant, weight=args.weight, **caps)  # type: ignore[arg-type]
    _print_policy(view)
    return 0


def run_policy_show(args: argparse.Namespace) -> int:
    from billing.service_classes import show_tenant_policy

    with ledger_session(args) as session:
        _print_policy(show_tenant_policy(session, args.tenant))
    return 0


def _print_classes(specs) -> None:  # type: ignore[no-untyped-def]
    print("name\tmin_budget_ms\tmax_budget_ms\tpriority\tcredit_ppm")
    for s in specs:
        print(f"{s.name}\t{s.min_budget_ms}\t{s.max_budget_ms}\t{s.priority}\t{s.credit_ppm}")


def run_class_add(args: argparse.Namespace) -> int:
    from billing.models import MAX_CLASS_BUDGET_MS
    from billing.service_classes import add_class

    with ledger_session(args) as session:
        spec = add_class(
            session,
            args.name,
            min_budget_ms=1 if args.min_budget_ms is None else args.min_budget_ms,
            max_budget_ms=MAX_CLASS_BUDGET_MS if args.max_budget_ms is None else args.max_budget_ms,
            priority=0 if args.priority is None else args.priority,
            credit_ppm=args.credit_ppm,
        )
    _print_classes([spec])
    return 0


def run_class_update(args: argparse.Namespace) -> int:
    from billing.service_classes import update_class

    with ledger_session(args) as session:
        spec = update_class(
            session,
            args.name,
            min_budget_ms=args.min_budget_ms,
            max_budget_ms=args.max_budget_ms,
            priority=args.priority,
            credit_ppm=args.credit_ppm,
        )
    _print_classes([spec])
    return 0


def run_class_list(args: argparse.Namespace) -> int:
    from billing.service_classes import list_classes

    with ledger_session(args) as session:
        _print_classes(list_classes(session))
    return 0


def _class_options(p: argparse.ArgumentParser, *, credit_required: bool) -> None:
    p.add_argument("name", help="1..32 characters of [a-z0-9_-]; never changes")
    p.add_argument("--min-budget-ms", type=int, default=None, help="the shortest call budget the class accepts")
    p.add_argument("--max-budget-ms", type=int, default=None, help="the longest (at most a day)")
    p.add_argument("--priority", type=int, default=None, help="0..100, higher is admitted first under overload")
    p.add_argument(
        "--credit-ppm",
        type=int,
        required=credit_required,
        default=None,
        help="share of a missed call's charge credited, per million (1000000: all); never changes",
    )


def add_class_commands(sub: argparse._SubParsersAction, tenants: argparse._SubParsersAction) -> None:
    """`classes …` under `sub` and `policy …` under the `tenants` group."""
    classes = sub.add_parser("classes", aliases=["class"], help="classes of service").add_subparsers(
        required=True, metavar="ACTION"
    )
    _class_options(ledger_command(classes, "add", "add a class of service", run_class_add), credit_required=True)
    update = "change a class's budgets or priority (its credit rule never changes)"
    _class_options(ledger_command(classes, "update", update, run_class_update), credit_required=False)
    ledger_command(classes, "list", "list the classes of service", run_class_list)

    policy = tenants.add_parser("policy", help="a tenant's weight in fair share and its caps").add_subparsers(
        required=True, metavar="ACTION"
    )
    p = ledger_command(policy, "set", "set a tenant's weight and caps (the others stay as they are)", run_policy_set)
    p.add_argument("tenant")
    p.add_argument("--weight", type=int, default=None, help="1..1000, its share under overload (default 1)")
    device = p.add_mutually_exclusive_group()
    device.add_argument("--device-us-per-month", type=int, default=None, help="device time cap, unit·µs per month")
    device.add_argument("--device-hours-per-month", default=None, help="the same in unit·hours (a decimal)")
    spend = p.add_mutually_exclusive_group()
    spend.add_argument("--spend-micros-per-month", type=int, default=None, help="spend cap, currency micro-units")
    spend.add_argument("--spend-per-month", default=None, help="the same in currency units (a decimal, e.g. 12.50)")
    p.add_argument("--calls-per-s", type=int, default=None, help="calls admitted per second")
    p.add_argument(
        "--clear",
        action="append",
        default=[],
        choices=(*CAP_NAMES, *CAP_NAMES.values()),
        help="remove a cap (device, spend or calls); may be repeated",
    )
    ledger_command(policy, "show", "show a tenant's weight and caps", run_policy_show).add_argument("tenant")
