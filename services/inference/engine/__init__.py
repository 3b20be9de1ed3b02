"""The engine: the step loop (engine.py: schedule, run, update, emit) and its process boundary, split as vLLM v1
splits it: core.py is the child's side (the loop it runs and the relay that ships each step), client.py the
server's side (`EngineClient`, which stands in for the engine), messages.py what crosses the pipe. Beside them:
the step digest the observers see (digest.py), the calibration of the cost model (calibration.py), paced steps
(pacing.py), incremental detokenizing (detokenizer.py) and the log of step starts (steplog.py).

It may import sched/, cost/ (the cost model) and device/'s torch-free modules (spec.py, cpus.py), but no torch at
import: what needs torch (the executor, the checkpoint's weights) is imported where the child builds the engine.
"""
