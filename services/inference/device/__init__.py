"""The device: the only torch in the replica. The executor (executor.py, the only CUDA, with the CUDA graphs of
cuda_graphs.py) runs each scheduled step on the model (model.py, attention.py; packed.py on the CPU kernels of
kernels/) and samples (sampler.py); loader.py reads a checkpoint, config.py its model card; nvml.py and cpus.py
describe and pin the hardware. spec.py holds the plain types the engine and the server share with it (no torch).

It may import torch, sched/ (the scheduler's output it runs) and its own modules; nothing above it.
"""
