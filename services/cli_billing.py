"""`zeroqueue` subcommands for the ledger: metering, migrate, tenants (and their policies), classes, keys, prices,
invoice, chargeback.

Every one takes `--ledger URL` (default: the SQLite file in $ZEROQUEUE_HOME or ~/.zeroqueue). A domain
error (unknown tenant, finalized invoice, unmigrated ledger, ...) prints one line to stderr and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from services.cli_ledger import ERROR_EXIT, ledger_command, ledger_session, ledger_url, require_migrated
from services.cli_service_classes import add_class_commands

KEY_NOTICE = "This API key is shown only once and cannot be recovered (only its hash is stored); store it now."


def emit(text: str, output: str | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    Path(output).write_text(text, encoding="utf-8")
    print(f"wrote {output}", file=sys.stderr)


# --- metering ------------------------------------------------------------------------------------------------


def run_metering(args: argparse.Namespace) -> int:
    from services.metering.server import MeteringApp

    if (args.tls_cert is None) != (args.tls_key is None):
        print("zeroqueue: error: --tls-cert and --tls-key go together", file=sys.stderr)
        return ERROR_EXIT
    app = MeteringApp(ledger_url(args), args.host, args.port, args.tls_cert, args.tls_key)
    return asyncio.run(_serve_metering(app))


async def _serve_metering(app) -> int:  # type: ignore[no-untyped-def]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await app.start()
    except BaseException:
        await app.stop(grace_s=0)
        raise
    print(f"zeroqueue metering: SERVING on {app.host}:{app.port}", flush=True)
    await stop.wait()
    print("zeroqueue metering: stopping", flush=True)
    await app.stop()
    return 0


# --- ledger administration ---------------------------------------------------------------------------------------


def run_migrate(args: argparse.Namespace) -> int:
    from billing import commands
    from billing.db import make_engine
    from services.metering.schema import check_schema_at_head

    url = ledger_url(args)
    commands.migrate(url)
    engine = make_engine(url)
    try:
        print(f"ledger {engine.url.render_as_string(hide_password=True)}: at revision {check_schema_at_head(engine)}")
    finally:
        engine.dispose()
    return 0


def run_tenants_create(args: argparse.Namespace) -> int:
    from billing import commands

    url = ledger_url(args)
    require_migrated(url)
    print(commands.create_tenant(url, args.name))
    print(f"Tenant {args.name!r} created. {KEY_NOTICE}", file=sys.stderr)
    return 0


def run_keys_create_admin(args: argparse.Namespace) -> int:
    from billing import commands

    url = ledger_url(args)
    require_migrated(url)
    print(commands.create_admin_key(url))
    print(f"Admin key created: it can read and write every tenant's data. {KEY_NOTICE}", file=sys.stderr)
    return 0


def run_keys_list(args: argparse.Namespace) -> int:
    from billing import tenants

    with ledger_session(args) as session:
        for k in tenants.list_keys(session, args.tenant):
            state = "revoked" if k.revoked_at_us is not None else "active"
            print(f"{k.id}\t{k.tenant or '-'}\t{k.role.value}\t{k.key_prefix}…\t{state}")
    return 0


def run_keys_revoke(args: argparse.Namespace) -> int:
    from billing import tenants

    with ledger_session(args) as session:
        info = tenants.revoke_key(session, args.key_id)
    print(f"key {info.id} ({info.tenant or 'admin'}, {info.key_prefix}…) revoked", file=sys.stderr)
    return 0


def run_prices_add(args: argparse.Namespace) -> int:
    from billing import commands

    url = ledger_url(args)
    require_migrated(url)
    price = commands.add_price(
        url, args.model, args.unit, args.price_micros, args.currency, args.effective_from, service_class=args.klass
    )
    of_class = f" for class {price.service_class}" if price.service_class else " for every class without its own"
    print(
        f"price {price.id}: {price.model} {price.unit} at {price.price_micros} micro-{price.currency} per "
        f"{'SM' if price.unit == 'sm_us' else 'core'}·second from {args.effective_from}{of_class}"
    )
    return 0


# --- reports -------------------------------------------------------------------------------------------------


def run_invoice(args: argparse.Namespace) -> int:
    from billing import commands

    url = ledger_url(args)
    require_migrated(url)
    text = commands.invoice(
        url, args.tenant, args.period, args.finalize, args.format, by_request_kind=args.by_request_kind
    )
    emit(text, args.output)
    return 0


def run_chargeback(args: argparse.Namespace) -> int:
    from billing import commands

    url = ledger_url(args)
    require_migrated(url)
    by = [name.strip() for name in args.by.split(",") if name.strip()]
    emit(commands.chargeback(url, args.period, by, args.format, tenant=args.tenant), args.output)
    return 0


def add_billing_commands(sub: argparse._SubParsersAction) -> None:
    _add_metering(sub)
    ledger_command(sub, "migrate", "create or upgrade the ledger schema (Alembic, to head)", run_migrate)
    tenants = _add_tenants(sub)
    add_class_commands(sub, tenants)
    _add_keys(sub)
    _add_prices(sub)
    _add_invoice(sub)
    _add_chargeback(sub)


def _add_metering(sub: argparse._SubParsersAction) -> None:
    p = ledger_command(
        sub, "metering", "run the Metering service (ledger, invoices, chargeback) on its own", run_metering
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50052)
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain; with --tls-key, serve TLS only")
    p.add_argument("--tls-key", default=None, help="PEM private key")
    p.add_argument("--json-logs", action=argparse.BooleanOptionalAction, default=True)


def _add_tenants(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    tenants = sub.add_parser("tenants", help="manage tenants").add_subparsers(required=True, metavar="ACTION")
    ledger_command(
        tenants, "create", "create a tenant and print its first API key (once)", run_tenants_create
    ).add_argument("name", help="lowercase name: [a-z0-9][a-z0-9._-]{0,62}")
    return tenants


def _add_keys(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("keys", help="manage API keys").add_subparsers(required=True, metavar="ACTION")
    ledger_command(keys, "create-admin", "create an admin key (all tenants) and print it (once)", run_keys_create_admin)
    ledger_command(
        keys, "list", "list keys (id, tenant, role, prefix, created, revoked); never the keys", run_keys_list
    ).add_argument("--tenant", default=None)
    ledger_command(
        keys, "revoke", "revoke a key by id (replicas stop accepting it within their 30 s cache)", run_keys_revoke
    ).add_argument("key_id", type=int)


def _add_prices(sub: argparse._SubParsersAction) -> None:
    prices = sub.add_parser("prices", help="the price book").add_subparsers(required=True, metavar="ACTION")
    p = ledger_command(prices, "add", "add a price version (never edits an old one)", run_prices_add)
    p.add_argument("--model", required=True)
    p.add_argument("--unit", required=True, choices=("sm_us", "core_us"))
    p.add_argument("--price-micros", type=int, required=True, help="micro-units of the currency per unit·second")
    p.add_argument("--currency", default="USD")
    p.add_argument("--effective-from", required=True, help="ISO 8601 with a zone, e.g. 2026-11-01T00:00:00Z")
    p.add_argument(
        "--class", dest="klass", metavar="NAME", default="", help="a class's own price (default: every class's)"
    )


def _add_invoice(sub: argparse._SubParsersAction) -> None:
    p = ledger_command(
        sub, "invoice", "a tenant's invoice for a month: refresh the draft, or --finalize it", run_invoice
    )
    p.add_argument("--tenant", required=True)
    p.add_argument("--period", required=True, help="UTC calendar month, YYYY-MM")
    p.add_argument("--finalize", action="store_true", help="finalize the draft (the month must have ended)")
    p.add_argument("--format", choices=("json", "csv", "html"), default="json")
    p.add_argument(
        "--by-request-kind",
        action="store_true",
        help="CSV: one row per line and request kind, with a request_kind column at the end (JSON and HTML always "
        "list each line's kinds)",
    )
    p.add_argument("--output", default=None, help="write to this file instead of stdout")


def _add_chargeback(sub: argparse._SubParsersAction) -> None:
    p = ledger_command(
        sub, "chargeback", "usage, cost and deadline attainment by group, and device utilisation", run_chargeback
    )
    p.add_argument("--period", required=True, help="UTC calendar month, YYYY-MM")
    p.add_argument(
        "--by",
        default="cost_center",
        help="comma-separated: cost_center, team, model, tenant, day, service_class, request_kind, door, weight_dtype",
    )
    p.add_argument("--tenant", default=None, help="only this tenant's usage (no device utilisation)")
    p.add_argument("--format", choices=("csv", "json", "html"), default="csv")
    p.add_argument("--output", default=None, help="write to this file instead of stdout")
