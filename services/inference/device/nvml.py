"""GPU facts from NVML (nvidia-ml-py): name, UUID, MIG attributes, driver; and finding a device's handles for
telemetry.py. No CUDA here.

The usage record names the device by its NVML UUID (`GPU-…`, or `MIG-…` for a MIG slice), which is how
`nvidia-smi` and DCGM name it too; the SM count comes from torch, which sees the slice the process got.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class GpuFacts:
    uuid: str  # GPU-… or MIG-…
    name: str
    is_mig_slice: bool
    mig_mode_enabled: bool
    driver_version: str
    memory_total_bytes: int


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _candidates(pynvml):
    """(handle, parent, is MIG slice, parent's MIG mode on) for every GPU and every MIG slice."""
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        try:
            enabled = pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        except pynvml.NVMLError:  # a GPU without MIG says Not Supported
            enabled = False
        yield handle, handle, False, enabled
        if enabled:
            for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    yield pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j), handle, True, True
                except pynvml.NVMLError:  # an empty slot says Not Found
                    continue


def _match(pynvml, wanted: str):
    """(handle, parent, is MIG slice, MIG mode on, UUID) of the device whose UUID ends with `wanted`, or None."""
    for handle, parent, is_mig, mig_mode in _candidates(pynvml):
        uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
        if uuid.endswith(wanted):
            return handle, parent, is_mig, mig_mode, uuid
    return None


def find_handles(pynvml, wanted: str):
    """(the device's handle, its parent GPU's handle: the same for a whole GPU) for an initialised NVML, or None."""
    match = _match(pynvml, wanted)
    return None if match is None else match[:2]


def _find(pynvml, wanted: str) -> GpuFacts | None:
    match = _match(pynvml, wanted)
    if match is None:
        return None
    handle, parent, is_mig, mig_mode, uuid = match
    return GpuFacts(
        uuid,
        _text(pynvml.nvmlDeviceGetName(parent)),
        is_mig,
        mig_mode,
        _text(pynvml.nvmlSystemGetDriverVersion()),
        pynvml.nvmlDeviceGetMemoryInfo(handle).total,
    )


def gpu_facts(cuda_uuid: str) -> GpuFacts | None:
    """Facts of the device whose UUID torch reports (with or without the GPU-/MIG- prefix), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVML raises its own error types, or the library is missing
        log.warning("nvml_unavailable", error=str(exc))
        return None
    # The facts only name the device: a driver that starts but fails a query (a GPU fallen off the bus, MIG
    # being reconfigured) must not stop the replica, which then names the device from torch's facts.
    try:
        return _find(pynvml, cuda_uuid.removeprefix("GPU-").removeprefix("MIG-"))
    except pynvml.NVMLError as exc:
        log.warning("nvml_query_failed", cuda_uuid=cuda_uuid, error=str(exc))
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.warning("nvml_shutdown_failed", error=str(exc))
