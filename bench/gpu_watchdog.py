"""bench/gpu_check.py's watchdog part: the idle probe on the device, the watchdog over a batch of real steps (its
verdicts, and its cost per step in place), and the device's NVML readings as a replica's /metrics shows them
(a GPU only: on the CPU dry run there is no NVML device)."""

from __future__ import annotations

import statistics
import time

import gpu_parts as parts
from prometheus_client import CollectorRegistry
from watchdog_overhead import Stopwatch

from services.inference.device.spec import Device
from services.inference.device.telemetry import GpuTelemetry
from services.inference.engine.calibration import calibrate
from services.inference.health.watchdog import Watchdog, WatchdogConfig, WatchedExecutor, probe_us


def watchdog_check(out: dict, ckpt, device: str, batch: int, tokens: int) -> None:
    engine = parts.make_engine(ckpt, device, batch, graphs=True)
    cost = calibrate(engine)
    executor = engine.executor
    calibrated_us = probe_us(executor)
    out["probe_us"] = {"calibrated": round(calibrated_us, 1)}
    verdicts: list = []
    watchdog = Watchdog(WatchdogConfig(), lambda state, ratio, why: verdicts.append((state.value, round(ratio, 3))))
    parts.add_calls(engine, parts.Sink(), "watched", batch, tokens, seed=batch)
    inner = Stopwatch(executor)
    outer = Stopwatch(WatchedExecutor(inner, watchdog, cost, calibrated_us))
    engine.executor = outer
    between_us, steps_us = [], []
    watchdog.start()
    try:
        while engine.has_work:
            report = engine.step()
            if report is not None and report.result is not None:
                between_us.append((outer.last_ns - inner.last_ns) / 1000)
                steps_us.append(report.interval_ns / 1000)
    finally:
        watchdog.stop()
    out |= {
        "steps": len(steps_us),
        "state": watchdog.state.value,
        "verdicts": verdicts,
        "step_us_median": round(statistics.median(steps_us), 1),
        "watchdog_us_per_step_median": round(statistics.median(between_us), 2),
        "watchdog_pct_of_step": round(100 * statistics.median(between_us) / statistics.median(steps_us), 3),
    }
    out["telemetry"] = telemetry_readings(executor.info) if device == "cuda" else "cpu: no NVML device to read"


def telemetry_readings(device: Device) -> dict:
    """One scrape's worth of the device's NVML metrics, and what a scrape costs."""
    telemetry = GpuTelemetry(device.device_id)
    if not telemetry.start():
        return {"started": False}
    registry = CollectorRegistry()
    registry.register(telemetry)
    try:
        scrape_ms = [_elapsed_us(lambda: list(registry.collect())) / 1000 for _ in range(10)]
        samples = {
            sample.name + (str(sorted(sample.labels.items())) if sample.labels else ""): sample.value
            for family in registry.collect()
            for sample in family.samples
        }
        return {"started": True, "scrape_ms_median": round(statistics.median(scrape_ms), 3), "samples": samples}
    finally:
        telemetry.close()


def _elapsed_us(operation) -> float:
    started_ns = time.perf_counter_ns()
    operation()
    return (time.perf_counter_ns() - started_ns) / 1000
