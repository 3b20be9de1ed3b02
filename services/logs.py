"""One logging set-up for every zeroqueue process (the engine's child process calls it too)."""

from __future__ import annotations

import logging

import structlog


def configure_logging(json_logs: bool) -> None:
    renderer = structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            # fields a handler binds for its call (the servicer: tenant, service_class) go on each of its lines
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper("iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )
