"""GPU facts from NVML (nvidia-ml-py): name, UUID, MIG attributes, driver. No CUDA here.

The usage record names the device by its NVML UUID (`GPU-…`, or `MIG-…` for a MIG slice), which is how
`nvidia-smi` and DCGM name it too; the SM count comes from torch, which sees the slice the process got.
"""
from __future__ import annotations

from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class GpuFacts:
    uuid: str               # GPU-… or MIG-…
    name: str
    is_mig_slice: bool
    mig_mode_enabled: bool
    driver_version: str
    memory_total_bytes: int


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _candidates(pynvml):
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        yield handle, handle, False
        try:
            enabled = pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        except pynvml.NVMLError:
            enabled = False
        if enabled:
            for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    yield pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j), handle, True
                except pynvml.NVMLError:
                    continue


def gpu_facts(cuda_uuid: str) -> GpuFacts | None:
    """Facts of the device whose UUID torch reports (with or without the GPU-/MIG- prefix); None when NVML
    is not available (no driver, a container without it)."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVML raises its own error types, or the library is missing
        log.warning("nvml_unavailable", error=str(exc))
        return None
    wanted = cuda_uuid.removeprefix("GPU-").removeprefix("MIG-")
    try:
        for handle, parent, is_mig in _candidates(pynvml):
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            if uuid.endswith(wanted):
                mig_mode = pynvml.nvmlDeviceGetMigMode(parent)[0] == pynvml.NVML_DEVICE_MIG_ENABLE if is_mig else False
                return GpuFacts(uuid, _text(pynvml.nvmlDeviceGetName(parent)), is_mig, mig_mode,
                                _text(pynvml.nvmlSystemGetDriverVersion()),
                                pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        return None
    finally:
        pynvml.nvmlShutdown()
