"""The device: the only torch in the replica. The executor (executor.py, the only CUDA, with the CUDA graphs of
cuda_graphs.py) runs each scheduled step on the model (model.py, attention.py; packed.py on the CPU kernels of
kernels/) and samples (sampler.py); loader.py reads a checkpoint's weights, config.py its model's shape; nvml.py
and cpus.py describe and pin the hardware.

Some modules here never import torch, so the server process may use them: spec.py (the plain types the engine and
the server share), checkpoint.py (a checkpoint's header: config and tokenizer), nvml.py, and telemetry.py (the device's
readings for Prometheus, taken in the server process at scrape time).

It may import torch, sched/ (the scheduler's output it runs) and its own modules; nothing above it.
"""
