"""The device's state, as the engine's watchdog judges it (watchdog.py) and the server reacts to it (reaction.py)."""

from __future__ import annotations

import enum


class DeviceState(enum.StrEnum):
    HEALTHY = "healthy"
    SLOW = "slow"  # steps persistently slower than calibrated: admission's cost model follows
    FAILED = "failed"  # an operation hung: this replica serves nothing until the device answers again
