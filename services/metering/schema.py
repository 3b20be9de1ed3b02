"""Is the ledger's schema the one this code was written for? Serving never migrates: `zeroqueue migrate` does."""

from __future__ import annotations

from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine
from sqlalchemy.engine import make_url

import migrations


class LedgerNotMigrated(RuntimeError):
    """The ledger is empty, behind, or ahead of the migrations shipped with this code."""


def check_schema_at_head(engine: Engine) -> str:
    """The ledger's revision when it is at head; otherwise LedgerNotMigrated with the command that fixes it."""
    url = engine.url.render_as_string(hide_password=True)
    heads = set(ScriptDirectory.from_config(migrations.alembic_config(url)).get_heads())
    with engine.connect() as connection:
        current = set(MigrationContext.configure(connection).get_current_heads())
    if current == heads:
        return ", ".join(sorted(current))
    found = ", ".join(sorted(current)) or "no schema"
    raise LedgerNotMigrated(
        f"the ledger at {url} has {found}, this code needs revision {', '.join(sorted(heads))}: "
        f"run `zeroqueue migrate --ledger {quoted(url)}` first"
    )


def quoted(url: str) -> str:
    return f"'{url}'" if make_url(url).query else url
