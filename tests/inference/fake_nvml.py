"""A fake pynvml module for tests: the calls gpu_facts and the telemetry make, no GPU or driver needed."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml as real_nvml

H100 = "GPU-5e6f7a8b-1111-2222-3333-444455556666"
A100 = "GPU-0a1b2c3d-aaaa-bbbb-cccc-ddddeeeeffff"
SLICE = "MIG-9f8e7d6c-5555-6666-7777-888899990000"
OTHER_SLICE = "MIG-12345678-0000-0000-0000-000000000000"
DRIVER = "550.54.15"


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's name
    pass


class NVMLError_Timeout(NVMLError):  # noqa: N801 - pynvml's name
    pass


# the constants the code reads, with nvidia-ml-py's own values: a name it lacks fails here, not on a GPU
CONSTANTS = [
    "NVML_CLOCK_SM",
    "NVML_CLOCK_MEM",
    "NVML_TEMPERATURE_GPU",
    "NVML_MEMORY_ERROR_TYPE_CORRECTED",
    "NVML_MEMORY_ERROR_TYPE_UNCORRECTED",
    "NVML_VOLATILE_ECC",
    "nvmlEventTypeXidCriticalError",
    *(n for n in dir(real_nvml) if n.startswith("nvmlClocksEventReason")),
]


@dataclass
class Dev:
    uuid: str | bytes
    name: str | bytes = "NVIDIA H100 80GB HBM3"
    memory: int = 80 << 30
    mig: bool | None = None  # None: not MIG-capable, the query raises as NVML's does
    slices: list[Dev | None] = field(default_factory=list)  # None: an empty slot, whose handle query raises
    # telemetry readings
    sm_mhz: int = 1980
    memory_mhz: int = 2619
    utilization: tuple[int, int] = (87, 40)  # % of the period a kernel ran, % memory busy
    used: int = 30 << 30
    celsius: int = 61
    milliwatts: int = 512_345
    reasons: int = 0  # clock-event reasons bitmask
    ecc: tuple[int, int] = (3, 0)  # corrected, uncorrected (volatile)
    xids: list[int] = field(default_factory=list)  # pending critical XID events


class FakeNvml(types.ModuleType):
    """The part of pynvml that gpu_facts and the telemetry call; `fail` names functions that raise NVMLError,
    `unsupported` those that raise NVMLError_NotSupported (both may change between calls)."""

    NVML_DEVICE_MIG_ENABLE = 1
    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_Timeout = NVMLError_Timeout

    def __init__(self, gpus: list[Dev], fail: tuple[str, ...] = (), unsupported: tuple[str, ...] = ()) -> None:
        super().__init__("pynvml")
        self.gpus, self.fail, self.unsupported, self.calls = gpus, set(fail), set(unsupported), []
        for name in CONSTANTS:
            setattr(self, name, getattr(real_nvml, name))

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise NVMLError(f"{name}: Unknown Error")
        if name in self.unsupported:
            raise NVMLError_NotSupported("Not Supported")

    def nvmlInit(self) -> None:
        self._call("nvmlInit")

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Dev:
        self._call("nvmlDeviceGetHandleByIndex")
        return self.gpus[i]

    def nvmlDeviceGetMigMode(self, handle: Dev) -> tuple[int, int]:
        self._call("nvmlDeviceGetMigMode")
        if handle.mig is None:
            raise NVMLError("Not Supported")
        return (int(handle.mig), int(handle.mig))

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Dev) -> int:
        self._call("nvmlDeviceGetMaxMigDeviceCount")
        return len(handle.slices)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Dev, j: int) -> Dev:
        self._call("nvmlDeviceGetMigDeviceHandleByIndex")
        if handle.slices[j] is None:
            raise NVMLError("Not Found")
        return handle.slices[j]

    def nvmlDeviceGetUUID(self, handle: Dev) -> str | bytes:
        self._call("nvmlDeviceGetUUID")
        return handle.uuid

    def nvmlDeviceGetName(self, handle: Dev) -> str | bytes:
        self._call("nvmlDeviceGetName")
        return handle.name

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._call("nvmlSystemGetDriverVersion")
        return DRIVER

    def nvmlDeviceGetMemoryInfo(self, handle: Dev) -> SimpleNamespace:
        self._call("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=handle.memory, free=handle.memory - handle.used, used=handle.used)

    def nvmlDeviceGetClockInfo(self, handle: Dev, clock: int) -> int:
        self._call("nvmlDeviceGetClockInfo")
        return handle.sm_mhz if clock == real_nvml.NVML_CLOCK_SM else handle.memory_mhz

    def nvmlDeviceGetUtilizationRates(self, handle: Dev) -> SimpleNamespace:
        self._call("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=handle.utilization[0], memory=handle.utilization[1])

    def nvmlDeviceGetTemperature(self, handle: Dev, sensor: int) -> int:
        self._call("nvmlDeviceGetTemperature")
        return handle.celsius

    def nvmlDeviceGetPowerUsage(self, handle: Dev) -> int:
        self._call("nvmlDeviceGetPowerUsage")
        return handle.milliwatts

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Dev) -> int:
        self._call("nvmlDeviceGetCurrentClocksEventReasons")
        return handle.reasons

    def nvmlDeviceGetTotalEccErrors(self, handle: Dev, error_type: int, counter_type: int) -> int:
        self._call("nvmlDeviceGetTotalEccErrors")
        return handle.ecc[error_type == real_nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED]

    def nvmlEventSetCreate(self) -> list[Dev]:
        self._call("nvmlEventSetCreate")
        return []

    def nvmlDeviceRegisterEvents(self, handle: Dev, event_types: int, event_set: list[Dev]) -> None:
        self._call("nvmlDeviceRegisterEvents")
        event_set.append(handle)

    def nvmlEventSetWait_v2(self, event_set: list[Dev], timeout_ms: int) -> SimpleNamespace:
        self._call("nvmlEventSetWait_v2")
        for handle in event_set:
            if handle.xids:
                return SimpleNamespace(eventType=real_nvml.nvmlEventTypeXidCriticalError, eventData=handle.xids.pop(0))
        raise NVMLError_Timeout("Timeout")

    def nvmlEventSetFree(self, event_set: list[Dev]) -> None:
        self._call("nvmlEventSetFree")


def install(monkeypatch, gpus: list[Dev], fail: tuple[str, ...] = (), unsupported: tuple[str, ...] = ()) -> FakeNvml:
    fake = FakeNvml(gpus, fail, unsupported)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def mig_host() -> list[Dev]:
    """A MIG-enabled H100 with an empty slot and two slices, beside a plain A100."""
    slices = [None, Dev(OTHER_SLICE, name="slice", memory=10 << 30), Dev(SLICE, name="slice", memory=20 << 30)]
    return [Dev(H100, mig=True, slices=slices), Dev(A100, name="NVIDIA A100-SXM4-40GB", memory=40 << 30, mig=False)]
