"""Request state and the scheduler: a request's sampling parameters, status and tokens (request.py), and the
scheduler that picks each step's decodes and prompt chunks within the slot and token budgets and applies the
step's sampled tokens (scheduler.py). Plain Python that runs on the engine's thread and in tests with fake model
outputs. It may import the standard library and its own modules only: no torch, no engine, no device.
"""
