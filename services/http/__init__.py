"""The HTTP door: the OpenAI- and Anthropic-compatible API on the replica itself (issue 32), on the gRPC server's
event loop, in front of the same admission, engine, meter and ledger.

door.py serves it (Starlette under uvicorn); limits.py bounds a request before it is parsed; bodies.py declares the
three APIs' bodies (pydantic); calls.py turns a body and its headers into the gRPC door's own GenerateRequest, so
one validation (services/inference/generate_request.py) and one admission decide both doors; replies.py writes the
results in each API's shape, and refusals.py maps the one domain error map (services/errors.py, services/status.py)
to HTTP statuses, headers and each API's error body. May import services/, billing/ and the generated protos; never
torch."""
