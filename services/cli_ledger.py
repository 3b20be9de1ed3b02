"""What every `zeroqueue` command on the ledger shares (cli_billing.py's and cli_service_classes.py's): the
`--ledger URL` option, the URL it defaults to, the check that the ledger is migrated, one unit of work on it, and
expected failures as one line on stderr with exit status 1.

Its imports of SQLAlchemy and billing/ wait inside the functions, so that `zeroqueue health` and `--help` start
without them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Callable, Iterator

ERROR_EXIT = 1


def fails_cleanly(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Expected failures become one line on stderr and exit status 1; anything else is a bug and keeps its trace."""

    @functools.wraps(run)
    def wrapper(args: argparse.Namespace) -> int:
        from sqlalchemy.exc import OperationalError

        from billing.errors import BillingError
        from services.metering.schema import LedgerNotMigrated

        try:
            return run(args)
        except (BillingError, LedgerNotMigrated) as error:
            message = str(error)
        except OperationalError as error:
            message = f"cannot use the ledger: {str(error.orig or error).strip().splitlines()[0]}"
        except OSError as error:
            message = f"{error.strerror or error}: {error.filename}" if error.filename else str(error)
        print(f"zeroqueue: error: {message}", file=sys.stderr)
        return ERROR_EXIT

    return wrapper


def ledger_url(args: argparse.Namespace) -> str:
    from billing.db import default_ledger_url

    return args.ledger or default_ledger_url()


def require_migrated(url: str) -> None:
    from billing.db import make_engine
    from services.metering.schema import check_schema_at_head

    engine = make_engine(url)
    try:
        check_schema_at_head(engine)
    finally:
        engine.dispose()


@contextlib.contextmanager
def ledger_session(args: argparse.Namespace) -> Iterator:
    """One unit of work on the command's (migrated) ledger; this command is the caller that commits."""
    from billing.commands import sessions
    from billing.db import unit_of_work

    url = ledger_url(args)
    require_migrated(url)
    with sessions(url) as factory, unit_of_work(factory) as session:
        yield session


def ledger_command(
    sub: argparse._SubParsersAction, name: str, help_text: str, run: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """A subcommand `name` on the ledger: it takes --ledger and runs `run`, failing cleanly."""
    p = sub.add_parser(name, help=help_text)
    p.add_argument(
        "--ledger",
        metavar="URL",
        default=None,
        help="ledger database URL (default: SQLite in $ZEROQUEUE_HOME or ~/.zeroqueue)",
    )
    p.set_defaults(run=fails_cleanly(run))
    return p
