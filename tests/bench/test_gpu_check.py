"""bench/gpu_check.py's dry run on CPU, so the prepared GPU script cannot rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def gpu_check(tmp_path, *args, env=None):
    env = {**os.environ, "OUT": str(tmp_path), **(env or {})}
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    return done, report


@pytest.mark.slow
def test_gpu_check_dry_run_reports_every_part(tmp_path):
    done, report = gpu_check(tmp_path, "--dry-run")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (tmp_path / "gpu_check.log").read_text()
    parts = (
        "environment",
        "greedy",
        "replay",
        "sampling",
        "logits",
        "speed",
        "fp8",
        "kernels",
        "metering",
        "watchdog",
        "engine_process",
    )
    assert [line.split("--- ")[1] for line in log.splitlines() if "--- " in line] == list(parts)
    assert not [p for p in parts if "error" in report[p]]
    assert report["mode"].startswith("dry-run") and report["environment"]["device"]["unit"] == "core_us"
    assert report["environment"]["torch"] and "cudnn" in report["environment"]
    for batch in ("1", "4"):
        assert report["greedy"][batch]["identical_sequences"] == f"{batch}/{batch}"
        replay = report["replay"][batch]
        assert replay["bitwise_equal"] and replay["bucket"][1] == 128
    # the 32-call batch is prefilled in chunks while its 4-token calls decode: some end before the comparison
    assert report["replay"]["32"]["bitwise_equal"] and 0 < report["replay"]["32"]["decoding"] < 32
    assert report["sampling"]["identical_tokens"] == "32/32"
    assert all(p["same_argmax"] and p["max_abs_diff"] == 0.0 for p in report["logits"].values())
    speed = report["speed"]
    assert speed["graph_b1"]["tokens_per_s"] > 0 and speed["graph_b4"]["floor_ms"] > speed["graph_b1"]["floor_ms"]
    assert speed["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2  # k and v, 2 layers, 2 KV heads, head 16, bf16
    fp8 = report["fp8"]  # on the CPU, Fp8Linear through torch._scaled_mm: that the part runs, not a GPU's figures
    assert fp8["parity"]["ok"] and 0 < fp8["parity"]["worst"] < fp8["parity"]["tolerance"]
    assert len(fp8["greedy_tokens_before_first_difference"]) == 8 and fp8["fp8_over_bf16_b1"] > 0
    assert fp8["speed_fp8"]["graph_b4"]["sm_us_per_token"] > 0
    kernels = report["kernels"]
    assert kernels["graph_replay"]["used_graph"] and not kernels["eager_step"]["used_graph"]
    assert kernels["eager_step"]["attention"] and kernels["graph_replay"]["top"]
    metering = report["metering"]
    assert metering["billed_equals_sum_of_records"] and metering["billed_plus_idle_equals_wall"]
    assert metering["records"] == 4
    watchdog = report["watchdog"]
    assert watchdog["state"] == "healthy" and watchdog["verdicts"] == [] and watchdog["steps"] > 0
    assert watchdog["probe_us"]["calibrated"] > 0 and watchdog["watchdog_us_per_step_median"] > 0
    assert watchdog["telemetry"].startswith("cpu")  # no NVML device on the dry run
    served = report["engine_process"]
    assert served["calibrated_rows"] and set(served["calls"]) == {"greedy-0", "greedy-1", "default-0", "default-1"}
    for call in served["calls"].values():
        assert call["tokens"] == 16 and call["finish_reason"] == "length" and call["outcome"] == "ok"
        assert call["unit"] == "core_us" and call["unit_us"] > 0


def test_gpu_check_without_cuda_and_without_dry_run_fails_and_says_why(tmp_path):
    done, report = gpu_check(tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    assert "no CUDA device" in report["error"] and "mode" not in report
