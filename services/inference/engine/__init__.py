"""The engine: the step loop (engine.py: schedule, run, update, emit) and the one boundary the server sees,
`EngineHandle` (handle.py), with its two sides: the engine in a child process, split as vLLM v1 splits it (core.py
is the child's side: the loop it runs, the relay that ships each step, and `build_engine`, which builds the engine
whole once calibrated; client.py the server's side, `EngineClient`), or on a thread of the server's process
(thread.py, `EngineThread`). messages.py declares every message across the pipe, typed, and its one encoding to
plain tuples. Beside them: the step digest the observers see (digest.py), the calibration of the cost model
(calibration.py), paced steps (pacing.py) and incremental detokenizing (detokenizer.py). The engine's requests are
keyed by the replica's call id (`call_id`), never by the caller's request_id.

It may import sched/, health/'s torch-free modules (the watchdog, the device's state, injected faults; not
reaction.py), cost/ (the cost model) and device/'s torch-free modules (spec.py, cpus.py), but no torch at
import: what needs torch (the executor, the checkpoint's weights) is imported where the engine is built.
"""
