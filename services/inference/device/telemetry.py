"""Device telemetry as Prometheus collectors, read at scrape time in the server process (no torch, no CUDA).

`GpuTelemetry` reads the replica's GPU from NVML (nvidia-ml-py): SM and memory clocks, utilisation, memory used,
temperature, power, clock-event (throttle) reasons, and its XID and ECC error counts. A MIG slice reports its own
memory; clocks, utilisation, temperature, power, throttling and XIDs are the parent GPU's, which the slice shares.
`HostSteal` reads the host's steal time from /proc/stat: on a VM, the time the hypervisor gave this machine's
vCPUs to someone else, which a CPU replica sees as slower steps.

A reading NVML does not support on this device (NotSupported) is left out; any other NVML error is
`zeroqueue_gpu_telemetry_up 0` for that scrape, and logged when it starts and when it clears. Every metric is
documented in docs/OPERATIONS.md ("Device telemetry").
"""

from __future__ import annotations

import os
import types
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .nvml import find_handles

log = structlog.get_logger(__name__)

# clock-event reason label -> the pynvml constant's suffix (nvmlClocksEventReason…, formerly …ThrottleReason…)
THROTTLE_REASONS = {
    "gpu_idle": "GpuIdle",
    "applications_clocks_setting": "ApplicationsClocksSetting",
    "sw_power_cap": "SwPowerCap",
    "hw_slowdown": "HwSlowdown",
    "sync_boost": "SyncBoost",
    "sw_thermal_slowdown": "SwThermalSlowdown",
    "hw_thermal_slowdown": "HwThermalSlowdown",
    "hw_power_brake_slowdown": "HwPowerBrakeSlowdown",
    "display_clock_setting": "DisplayClockSetting",
}
MAX_XID_EVENTS_PER_SCRAPE = 1024  # a storm of XIDs is drained over several scrapes, not in one


class GpuTelemetry:
    """A collector for one GPU (or MIG slice), by the UUID the replica bills it under."""

    def __init__(self, device_id: str, nvml: types.ModuleType | None = None) -> None:
        self.device_id = device_id
        self._nvml = nvml
        self._handle = self._parent = self._events = None
        self._xids: Counter[int] = Counter()
        self._failing = False

    def describe(self) -> list[Metric]:
        return []  # the metrics depend on what the device supports: collect() says, at scrape time

    def start(self) -> bool:
        """Initialises NVML and finds the device; False (logged) when the library or the device is missing."""
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVML raises its own error types, or the library is missing
            log.warning("gpu_telemetry_unavailable", error=str(exc))
            return False
        nvml = self._nvml
        try:
            handles = find_handles(nvml, self.device_id.removeprefix("GPU-").removeprefix("MIG-"))
        except nvml.NVMLError as exc:
            handles = None
            log.warning("gpu_telemetry_unavailable", device_id=self.device_id, error=str(exc))
        if handles is None:
            log.warning("gpu_telemetry_no_device", device_id=self.device_id)
            self.close()
            return False
        self._handle, self._parent = handles
        self._events = self._register_xids()
        return True

    def _register_xids(self):
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(self._parent, nvml.nvmlEventTypeXidCriticalError, events)
        except nvml.NVMLError as exc:  # not supported on this device or driver: no XID counts
            log.warning("gpu_xid_events_unavailable", device_id=self.device_id, error=str(exc))
            return None
        return events

    def close(self) -> None:
        if self._nvml is None:
            return
        self._handle = None  # no more readings
        nvml = self._nvml
        try:
            if self._events is not None:
                nvml.nvmlEventSetFree(self._events)
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:
            log.warning("nvml_shutdown_failed", error=str(exc))
        self._events = None

    def collect(self) -> Iterator[Metric]:
        if self._handle is None:
            return
        readings: list[Metric] = []
        try:
            self._read(readings)
        except self._nvml.NVMLError as exc:  # the device stopped answering: no readings this scrape
            if not self._failing:
                log.error("gpu_telemetry_failed", device_id=self.device_id, error=str(exc))
            self._failing = True
            yield _gauge("zeroqueue_gpu_telemetry_up", "1 when NVML answered this scrape", 0)
            yield self._xid_counter()
            return
        if self._failing:
            log.info("gpu_telemetry_recovered", device_id=self.device_id)
        self._failing = False
        yield _gauge("zeroqueue_gpu_telemetry_up", "1 when NVML answered this scrape", 1)
        yield from readings

    def _read(self, out: list[Metric]) -> None:
        nvml, gpu, own = self._nvml, self._parent, self._handle
        if (sm := self._supported(nvml.nvmlDeviceGetClockInfo, gpu, nvml.NVML_CLOCK_SM)) is not None:
            out.append(_gauge("zeroqueue_gpu_sm_clock_hertz", "SM clock", sm * 1_000_000))
        if (mem := self._supported(nvml.nvmlDeviceGetClockInfo, gpu, nvml.NVML_CLOCK_MEM)) is not None:
            out.append(_gauge("zeroqueue_gpu_memory_clock_hertz", "Memory clock", mem * 1_000_000))
        if (rates := self._supported(nvml.nvmlDeviceGetUtilizationRates, gpu)) is not None:
            out.append(
                _gauge(
                    "zeroqueue_gpu_utilization_ratio", "Share of the last sample period a kernel ran", rates.gpu / 100
                )
            )
            out.append(
                _gauge(
                    "zeroqueue_gpu_memory_utilization_ratio",
                    "Share of it memory was read or written",
                    rates.memory / 100,
                )
            )
        if (memory := self._supported(nvml.nvmlDeviceGetMemoryInfo, own)) is not None:
            out.append(
                _gauge("zeroqueue_gpu_memory_used_bytes", "Device memory in use (the slice's, on MIG)", memory.used)
            )
            out.append(_gauge("zeroqueue_gpu_memory_total_bytes", "Device memory (the slice's, on MIG)", memory.total))
        if (celsius := self._supported(nvml.nvmlDeviceGetTemperature, gpu, nvml.NVML_TEMPERATURE_GPU)) is not None:
            out.append(_gauge("zeroqueue_gpu_temperature_celsius", "GPU core temperature", celsius))
        if (milliwatts := self._supported(nvml.nvmlDeviceGetPowerUsage, gpu)) is not None:
            out.append(_gauge("zeroqueue_gpu_power_watts", "Power drawn by the board", milliwatts / 1000))
        if (reasons := self._throttle_reasons(gpu)) is not None:
            out.append(reasons)
        out.extend(self._ecc(own))
        self._drain_xids()
        out.append(self._xid_counter())

    def _supported(self, query: Callable, *args):
        """The query's answer, or None where NVML says this device does not support it."""
        try:
            return query(*args)
        except self._nvml.NVMLError_NotSupported:
            return None

    def _throttle_reasons(self, gpu) -> Metric | None:
        nvml = self._nvml
        query = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        query = query or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        mask = self._supported(query, gpu)
        if mask is None:
            return None
        family = GaugeMetricFamily(
            "zeroqueue_gpu_clocks_event_reason", "1 while this reason holds the clocks down", labels=["reason"]
        )
        for label, suffix in THROTTLE_REASONS.items():
            bit = getattr(nvml, f"nvmlClocksEventReason{suffix}", None) or getattr(
                nvml, f"nvmlClocksThrottleReason{suffix}"
            )
            family.add_metric([label], 1 if mask & bit else 0)
        return family

    def _ecc(self, own) -> list[Metric]:
        nvml = self._nvml
        family = CounterMetricFamily(
            "zeroqueue_gpu_ecc_errors", "ECC errors since the driver loaded (volatile)", labels=["type"]
        )
        for label, kind in (
            ("corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ("uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        ):
            count = self._supported(nvml.nvmlDeviceGetTotalEccErrors, own, kind, nvml.NVML_VOLATILE_ECC)
            if count is None:
                return []  # ECC off or not supported: no counts at all, rather than a half
            family.add_metric([label], count)
        return [family]

    def _drain_xids(self) -> None:
        """Counts the XID events that arrived since the last scrape; waits for none."""
        if self._events is None:
            return
        nvml = self._nvml
        for _ in range(MAX_XID_EVENTS_PER_SCRAPE):
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError_Timeout:
                return
            self._xids[int(event.eventData)] += 1
            log.error("gpu_xid", device_id=self.device_id, xid=int(event.eventData))

    def _xid_counter(self) -> Metric:
        family = CounterMetricFamily("zeroqueue_gpu_xid_errors", "Critical XID events, by XID code", labels=["xid"])
        for xid, count in sorted(self._xids.items()):
            family.add_metric([str(xid)], count)
        return family


class HostSteal:
    """A collector for the host's steal time (/proc/stat), absent where the kernel does not report it."""

    def __init__(self, stat_path: Path = Path("/proc/stat"), ticks_per_s: int | None = None) -> None:
        self.stat_path = stat_path
        self.ticks_per_s = ticks_per_s or os.sysconf("SC_CLK_TCK")

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            line = self.stat_path.read_text().splitlines()[0].split()
        except (OSError, IndexError):
            return
        if line[0] != "cpu" or len(line) < 9:  # steal is the 8th count after the label, since Linux 2.6.11
            return
        family = CounterMetricFamily(
            "zeroqueue_host_steal_seconds", "CPU time the hypervisor gave to other guests, all cores"
        )
        family.add_metric([], int(line[8]) / self.ticks_per_s)
        yield family


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
