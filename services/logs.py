"""One logging set-up for every zeroqueue process: the CLI and the servers it runs (services/cli.py), the engine's
child process, and the bench tools.

Every line goes to stderr: a command's stdout is its product (a key, CSV, JSON, a table) and a script pipes it.
Colours only when stderr is a terminal. A warning identical to one this process already printed (same event, same
fields: the ledger's directory open to others, found at each of a command's opens) is printed once.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, MutableMapping
from typing import Any

import structlog

# distinct warnings remembered for once-only printing; past this many, new ones print every time (a long-running
# server whose warnings differ by a count must not grow without end)
MAX_REMEMBERED_WARNINGS = 1024


def configure_logging(json_logs: bool = False, level: int = logging.INFO) -> None:
    renderer = (
        structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            # fields a handler binds for its call (the servicer: tenant, service_class) go on each of its lines
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            warnings_once(),
            structlog.processors.TimeStamper("iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=stderr_logger,
    )


def stderr_logger(*_names: Any) -> structlog.WriteLogger:
    """A logger writing to the sys.stderr of the moment (a test's capture, or a redirect made after set-up). Each line
    goes out in one write, newline included: PrintLogger's print() writes the line and its newline apart, so with
    stderr unbuffered the engine child's line and the server's could meet on one line of a shared log."""
    return structlog.WriteLogger(sys.stderr)


Processor = Callable[[Any, str, MutableMapping[str, Any]], MutableMapping[str, Any]]


def warnings_once(max_remembered: int = MAX_REMEMBERED_WARNINGS) -> Processor:
    """A processor that drops a warning identical to one it passed before (its set lives in the configuration,
    so once per process, and once again after the next configure_logging)."""
    seen: set[str] = set()

    def drop_repeats(_logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if method not in ("warning", "warn"):
            return event
        key = repr(sorted(event.items(), key=lambda item: item[0]))
        if key in seen:
            raise structlog.DropEvent
        if len(seen) < max_remembered:
            seen.add(key)
        return event

    return drop_repeats
