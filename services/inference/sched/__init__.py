"""Request state and the scheduler: a request's sampling parameters, status and tokens (request.py); the scheduler
that picks each step's decodes and prompt chunks within the slot and token budgets and applies the step's sampled
tokens (scheduler.py); and the pool of KV blocks each request reserves when it starts, with the prefix cache's index
of full blocks (blocks.py). Plain Python that runs on the engine's thread and in tests with fake model outputs. It
may import the standard library and its own modules only: no torch, no engine, no device.
"""
