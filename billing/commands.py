"""What the ``zeroqueue`` command runs against the ledger; each call is one unit of work.

``services/cli.py`` wires these to argparse; every function takes the ledger
URL (``--ledger``), ``None`` meaning the SQLite file in the data directory.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from sqlalchemy.orm import Session, sessionmaker

import migrations
from billing import invoices, pricing, tenants
from billing.chargeback import chargeback_report
from billing.db import default_ledger_url, make_engine, session_factory, unit_of_work
from billing.errors import InvalidPrice
from billing.models import InvoiceStatus
from billing.period import datetime_to_us
from billing.render import parse_format, render_chargeback, render_invoice


@contextmanager
def sessions(url: str | None) -> Iterator[sessionmaker[Session]]:
    """Sessions on the ledger at `url` (the default ledger if None), its engine disposed of after."""
    engine = make_engine(url or default_ledger_url())
    try:
        yield session_factory(engine)
    finally:
        engine.dispose()


def migrate(url: str | None = None) -> None:
    """Bring the ledger schema to the newest revision (idempotent; cheap when already there)."""
    migrations.upgrade(url or default_ledger_url())


def create_tenant(url: str | None, name: str) -> str:
    """Create a tenant; returns its API key, which is shown this once and stored only hashed."""
    with sessions(url) as factory, unit_of_work(factory) as session:
        return tenants.create_tenant(session, name).key


def create_admin_key(url: str | None) -> str:
    with sessions(url) as factory, unit_of_work(factory) as session:
        return tenants.create_admin_key(session).key


def add_price(
    url: str | None,
    model: str,
    unit: str,
    price_micros: int,
    currency: str,
    effective_from: str,
    *,
    service_class: str = pricing.GENERIC_PRICE,
) -> pricing.PriceVersion:
    """Add a price version; ``effective_from`` is an ISO 8601 UTC timestamp such as 2026-11-01T00:00:00Z, and
    ``service_class`` a class's name ('' : every class without a price of its own)."""
    try:
        moment = dt.datetime.fromisoformat(effective_from.replace("Z", "+00:00"))
    except ValueError as error:
        raise InvalidPrice(
            f"effective_from must be ISO 8601, got {effective_from!r}", field="effective_from"
        ) from error
    if moment.tzinfo is None:
        raise InvalidPrice("effective_from needs a time zone (e.g. Z)", field="effective_from")
    with sessions(url) as factory, unit_of_work(factory) as session:
        return pricing.add_price(
            session, model, unit, price_micros, currency, datetime_to_us(moment), service_class=service_class
        )


def invoice(
    url: str | None,
    tenant: str,
    period: str,
    finalize: bool = False,
    fmt: str = "json",
    *,
    by_request_kind: bool = False,
) -> str:
    """The tenant's invoice for ``period``: refreshes the draft (and finalizes it if asked);
    a finalized invoice is shown as it is. ``by_request_kind``: the CSV's lines split by request kind."""
    parse_format(fmt)
    with sessions(url) as factory, unit_of_work(factory) as session:
        current = invoices.find_open_invoice(session, tenant, period)
        if current is None or current.status is InvoiceStatus.DRAFT:
            current = invoices.create_or_refresh_draft(session, tenant, period)
            if finalize:
                current = invoices.finalize_invoice(session, current.id, refresh=False)
        return render_invoice(current, fmt, by_request_kind=by_request_kind)


def chargeback(url: str | None, period: str, by: Sequence[str], fmt: str = "csv", tenant: str | None = None) -> str:
    """The chargeback report for ``period`` grouped by ``by`` as CSV, JSON or HTML."""
    parse_format(fmt)
    with sessions(url) as factory, unit_of_work(factory) as session:
        return render_chargeback(chargeback_report(session, period, by, tenant=tenant), fmt)
