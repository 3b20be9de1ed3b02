"""The device's plain types, shared with the engine and the server: the executor's config, what a device is,
and what a step measured. No torch here, so the server process and the step loop import them without it."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

# --quantize: how the linear weights are held (quant.py): int8 and int4 on the CPU kernels (elsewhere their values in
# plain torch), fp8 (E4M3) on CUDA devices of compute capability 8.9+
QUANTIZE_CHOICES = ("none", "int8", "int4", "fp8")


@dataclass(frozen=True)
class ExecutorConfig:
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_batch: int = 32  # slots: calls that run at once, each holding only the KV blocks it reserved
    max_seq_len: int = 1024  # tokens one call may hold, capped by the model's context
    kv_memory_bytes: int = 2 << 30  # the paged KV cache's budget: the pool is at most this, its blocks shared
    # tokens per KV block: a multiple of 16, the kernels' row group (a smaller block shares prefixes finer)
    kv_block_size: int = 16
    num_threads: int = 0  # CPU threads; 0: all cores this process may use but one
    use_kernels: bool = True  # CPU: packed-weight kernels when the CPU supports them
    # the linear weights: "none" (the checkpoint's dtype), "int8", "int4" or "fp8" (quant.py; --quantize)
    quantize: str = "none"
    use_cuda_graphs: bool = True


@dataclass(frozen=True)
class Device:
    """The device a replica serves on, as the executor found it and as the meter bills it: a call's usage is
    unit·µs, its share of each step's time × num_units."""

    kind: str  # cpu | cuda
    name: str
    device_id: str  # GPU UUID (MIG-… for a slice), or cpu:<host>
    num_units: int  # compute units: SMs on a GPU, cores on a CPU
    unit: str  # sm_us | core_us


@dataclass(frozen=True)
class StepResult:
    sampled: dict[str, int]  # call id -> new token
    # measured: CUDA events around the forward on a GPU (the host's sampling and grammar masks run while the
    # device idles, outside it), a clock around the whole step on a CPU (its cores mask and sample: inside it)
    device_time_us: int
    num_padded_seqs: int  # sequences the step computed, padding of a graph bucket included
    used_graph: bool
    # call id -> (the token's log-probability, the top alternatives): the calls that asked (sampler.TokenLogprob)
    logprobs: dict[str, tuple] = field(default_factory=dict)
    grammar_errors: dict[str, str] = field(default_factory=dict)  # call id -> why its grammar's matcher failed
    num_masked_rows: int = 0  # rows drawn under a grammar's mask (the cost model's us_per_masked_row each)


class InjectedDeviceFault(RuntimeError):
    """A device fault made on purpose (`zeroqueue serve --inject-fault fail`, health/faults.py): handled as real."""


def is_device_fault(exc: BaseException) -> bool:
    """Whether a failed step left the device unusable: a CUDA error is sticky (a device-side assert fails every
    later launch), so the process that holds the context must go; any other failure ends the step's calls.
    Without torch imported (a fake executor), no torch error can have been raised."""
    if isinstance(exc, InjectedDeviceFault):
        return True
    torch = sys.modules.get("torch")
    return (torch is not None and isinstance(exc, torch.AcceleratorError)) or "CUDA error" in str(exc)
