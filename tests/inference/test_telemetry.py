"""Device telemetry against a fake pynvml and a fake /proc/stat: every metric, a MIG slice, what NVML does not
support, a missing library or device, a device that stops answering and comes back, and XID events."""

from __future__ import annotations

import sys

import pynvml as real_nvml
import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from services.inference.device.spec import Device
from services.inference.device.telemetry import THROTTLE_REASONS, GpuTelemetry, HostSteal
from services.inference.metrics import ServiceMetrics
from tests.inference.fake_nvml import A100, SLICE, install, mig_host


def watched(device_id: str) -> tuple[GpuTelemetry, CollectorRegistry]:
    telemetry, registry = GpuTelemetry(device_id), CollectorRegistry()
    assert telemetry.start()
    registry.register(telemetry)
    return telemetry, registry


def test_every_reading_of_a_whole_gpu(monkeypatch):
    fake = install(monkeypatch, mig_host())
    a100 = fake.gpus[1]
    a100.reasons = real_nvml.nvmlClocksEventReasonHwThermalSlowdown | real_nvml.nvmlClocksEventReasonSwPowerCap
    _, registry = watched(A100)
    value = registry.get_sample_value
    assert value("zeroqueue_gpu_telemetry_up") == 1
    assert value("zeroqueue_gpu_sm_clock_hertz") == 1980e6 and value("zeroqueue_gpu_memory_clock_hertz") == 2619e6
    assert value("zeroqueue_gpu_utilization_ratio") == 0.87
    assert value("zeroqueue_gpu_memory_utilization_ratio") == 0.40
    assert value("zeroqueue_gpu_memory_used_bytes") == 30 << 30
    assert value("zeroqueue_gpu_memory_total_bytes") == 40 << 30
    assert value("zeroqueue_gpu_temperature_celsius") == 61 and value("zeroqueue_gpu_power_watts") == 512.345
    held = {r for r in THROTTLE_REASONS if value("zeroqueue_gpu_clocks_event_reason", {"reason": r}) == 1}
    assert held == {"hw_thermal_slowdown", "sw_power_cap"}
    assert all(value("zeroqueue_gpu_clocks_event_reason", {"reason": r}) is not None for r in THROTTLE_REASONS)
    assert value("zeroqueue_gpu_ecc_errors_total", {"type": "corrected"}) == 3
    assert value("zeroqueue_gpu_ecc_errors_total", {"type": "uncorrected"}) == 0


def test_the_code_calls_only_what_nvidia_ml_py_has(monkeypatch):
    fake = install(monkeypatch, mig_host())
    telemetry, registry = watched(SLICE)
    registry.get_sample_value("zeroqueue_gpu_telemetry_up")
    telemetry.close()
    missing = {name for name in fake.calls if not hasattr(real_nvml, name)}
    assert missing == set() and "nvmlEventSetWait_v2" in fake.calls


def test_a_mig_slice_reports_its_memory_and_its_parents_clocks(monkeypatch):
    fake = install(monkeypatch, mig_host())
    parent, piece = fake.gpus[0], fake.gpus[0].slices[2]
    parent.sm_mhz, piece.sm_mhz = 1755, 1
    parent.used, piece.used = 70 << 30, 5 << 30
    _, registry = watched(SLICE)
    assert registry.get_sample_value("zeroqueue_gpu_sm_clock_hertz") == 1755e6
    assert registry.get_sample_value("zeroqueue_gpu_memory_used_bytes") == 5 << 30
    assert registry.get_sample_value("zeroqueue_gpu_memory_total_bytes") == 20 << 30


def test_what_the_device_does_not_support_is_left_out(monkeypatch):
    unsupported = ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetCurrentClocksEventReasons")
    install(monkeypatch, mig_host(), unsupported=unsupported)
    _, registry = watched(A100)
    assert registry.get_sample_value("zeroqueue_gpu_telemetry_up") == 1
    assert registry.get_sample_value("zeroqueue_gpu_temperature_celsius") == 61
    names = {metric.name for metric in registry.collect()}
    assert not names & {"zeroqueue_gpu_power_watts", "zeroqueue_gpu_ecc_errors", "zeroqueue_gpu_clocks_event_reason"}


def test_xid_events_are_counted_by_code_and_logged(monkeypatch):
    fake = install(monkeypatch, mig_host())
    _, registry = watched(A100)
    fake.gpus[1].xids += [79, 48, 79]
    with capture_logs() as logs:
        assert registry.get_sample_value("zeroqueue_gpu_xid_errors_total", {"xid": "79"}) == 2
    assert [(e["event"], e["xid"]) for e in logs] == [("gpu_xid", 79), ("gpu_xid", 48), ("gpu_xid", 79)]
    fake.gpus[1].xids.append(13)
    assert registry.get_sample_value("zeroqueue_gpu_xid_errors_total", {"xid": "79"}) == 2  # counts persist
    assert registry.get_sample_value("zeroqueue_gpu_xid_errors_total", {"xid": "13"}) == 1


def test_a_mig_slices_xids_are_its_parents(monkeypatch):
    fake = install(monkeypatch, mig_host())
    _, registry = watched(SLICE)
    fake.gpus[0].xids.append(94)
    assert registry.get_sample_value("zeroqueue_gpu_xid_errors_total", {"xid": "94"}) == 1


def test_no_xid_events_where_the_driver_cannot_register_them(monkeypatch):
    install(monkeypatch, mig_host(), unsupported=("nvmlDeviceRegisterEvents",))
    with capture_logs() as logs:
        _, registry = watched(A100)
    assert [e["event"] for e in logs] == ["gpu_xid_events_unavailable"]
    assert registry.get_sample_value("zeroqueue_gpu_temperature_celsius") == 61


def test_a_device_that_stops_answering_is_down_then_recovers(monkeypatch):
    fake = install(monkeypatch, mig_host())
    _, registry = watched(A100)
    fake.gpus[1].xids.append(79)
    assert registry.get_sample_value("zeroqueue_gpu_xid_errors_total", {"xid": "79"}) == 1
    fake.fail.add("nvmlDeviceGetClockInfo")  # e.g. a GPU fallen off the bus: GpuIsLost on every query
    with capture_logs() as logs:
        for _ in range(3):
            assert registry.get_sample_value("zeroqueue_gpu_telemetry_up") == 0
            assert registry.get_sample_value("zeroqueue_gpu_temperature_celsius") is None
            assert registry.get_sample_value("zeroqueue_gpu_xid_errors_total", {"xid": "79"}) == 1
    assert [e["event"] for e in logs] == ["gpu_telemetry_failed"]  # once, not on every scrape
    fake.fail.clear()
    with capture_logs() as logs:
        assert registry.get_sample_value("zeroqueue_gpu_telemetry_up") == 1
    assert [e["event"] for e in logs] == ["gpu_telemetry_recovered"]


def test_a_missing_library_means_no_gpu_metrics(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    with capture_logs() as logs:
        assert not GpuTelemetry(A100).start()
    assert [e["event"] for e in logs] == ["gpu_telemetry_unavailable"]
    metrics = ServiceMetrics()
    assert metrics.watch_device(Device("cuda", "gpu", A100, 108, "sm_us")) is None
    assert not [m for m in metrics.registry.collect() if m.name.startswith("zeroqueue_gpu_")]


def test_a_missing_device_means_no_gpu_metrics_and_nvml_shut_down(monkeypatch):
    fake = install(monkeypatch, mig_host())
    with capture_logs() as logs:
        assert not GpuTelemetry("GPU-00000000-0000-0000-0000-000000000000").start()
    assert [e["event"] for e in logs] == ["gpu_telemetry_no_device"] and fake.calls[-1] == "nvmlShutdown"


def test_the_service_metrics_watch_a_gpu_and_never_a_cpu(monkeypatch):
    fake = install(monkeypatch, mig_host())
    metrics = ServiceMetrics()
    assert metrics.watch_device(Device("cpu", "cpu", "cpu:host", 2, "core_us")) is None
    assert "nvmlInit" not in fake.calls
    telemetry = metrics.watch_device(Device("cuda", "NVIDIA A100-SXM4-40GB", A100, 108, "sm_us"))
    assert telemetry is not None and metrics.registry.get_sample_value("zeroqueue_gpu_power_watts") == 512.345
    telemetry.close()
    assert fake.calls[-2:] == ["nvmlEventSetFree", "nvmlShutdown"]


@pytest.mark.parametrize(
    ("stat", "steal_s"),
    [
        ("cpu  4705 356 584 3699 23 23 0 250 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n", 2.5),
        ("cpu  4705 356 584 3699 23 23 0\n", None),  # a kernel that does not count steal
        ("", None),
    ],
)
def test_host_steal_from_proc_stat(tmp_path, stat, steal_s):
    path = tmp_path / "stat"
    path.write_text(stat)
    registry = CollectorRegistry()
    registry.register(HostSteal(path, ticks_per_s=100))
    assert registry.get_sample_value("zeroqueue_host_steal_seconds_total") == steal_s


def test_the_service_metrics_carry_the_hosts_steal():
    assert ServiceMetrics().registry.get_sample_value("zeroqueue_host_steal_seconds_total") is not None
