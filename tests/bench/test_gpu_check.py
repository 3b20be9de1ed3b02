"""bench/gpu_check.py's dry run on CPU, so the prepared GPU script cannot rot between GPU runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_dry_run_reports_every_part(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (tmp_path / "gpu_check.log").read_text().count("---") == 5
    assert report["mode"].startswith("dry-run") and report["device"]["device"]["unit"] == "core_us"
    correctness = report["correctness"]
    for batch in ("1", "4"):
        assert correctness[batch]["identical_sequences"] == f"{batch}/{batch}"
        assert correctness["replay_vs_static"][batch]["bitwise_equal"]
    speed = report["speed"]
    assert speed["graph_b1"]["tokens_per_s"] > 0 and speed["bandwidth_floor_ms"] > 0
    metering = report["metering"]
    assert metering["billed_equals_sum_of_records"] and metering["billed_plus_idle_equals_wall"]
    assert metering["records"] == 4
