"""Device health: the device's state (state.py: `DeviceState`), the watchdog that judges it from the device's own
timings and hands each verdict on (watchdog.py; it runs in the engine, beside the device), faults injected on
purpose for tests and drills (faults.py), and the server's one reaction to a change of state (reaction.py: the cost
model follows, the calls in flight end billed, health statuses change, a recovery timer runs).

The engine imports state.py, watchdog.py and faults.py, so they stay torch-free and import only the standard
library, structlog, device/spec.py (the plain types, torch-free) and the cost model (cost/). reaction.py runs
in the server, on the event loop, and may import the service it acts on (service.py) and the engine's plain
types; nothing here imports reaction.py but the replica.
"""
