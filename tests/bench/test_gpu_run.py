"""The prepared H200 run (bench/gpu_run.sh): its scripts parse, and the image plus the carried wheels hold every
package gpu_check can import, at this environment's versions, so a lent machine's minutes are not lost at import."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The image has these, at other versions than the generated protos check for at import: they are carried.
OURS_ONLY = {"grpcio", "protobuf"}

# Imports bench/gpu_imports.py's entry modules with every distribution that the device lacks made unimportable,
# as there; optional imports (grpc's grpc_tools shim) fail quietly, as they would there.
TRACE_AS_ON_DEVICE = """
import importlib.abc, importlib.metadata, json, re, sys
allowed = set(json.loads(sys.argv[1]))
owners = importlib.metadata.packages_distributions()

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        missing = {re.sub(r"[-_.]+", "-", d).lower() for d in owners.get(name, [])} - allowed - {"zeroqueue"}
        if missing:
            raise ModuleNotFoundError(f"{name}: {sorted(missing)} neither in the H200 image nor carried", name=name)

sys.meta_path.insert(0, Absent())
sys.path.insert(0, "bench")
import gpu_imports
print(json.dumps(gpu_imports.trace()))
"""


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def entries(name: str) -> list[str]:
    lines = (ROOT / "bench" / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def pins() -> dict[str, str]:
    return {normal(name): version for name, _, version in (line.partition("==") for line in entries("gpu_wheels.txt"))}


def test_scripts_parse():
    for script in ("gpu_run.sh", "gpu_wheels.sh"):
        done = subprocess.run(["bash", "-n", ROOT / "bench" / script], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_wheels_pin_this_environment_and_leave_the_image_its_own():
    assert all(version for version in pins().values()), "every line is NAME==VERSION"
    assert {name: importlib.metadata.version(name) for name in pins()} == pins()
    image = {normal(name) for name in entries("gpu_image_packages.txt")}
    # torch, numpy, tokenizers... stay the image's (its torch is the CUDA build)
    assert set(pins()) & image == OURS_ONLY


def test_image_and_wheels_hold_everything_gpu_check_imports():
    allowed = sorted({normal(name) for name in entries("gpu_image_packages.txt")} - OURS_ONLY | set(pins()))
    done = subprocess.run(
        [sys.executable, "-c", TRACE_AS_ON_DEVICE, json.dumps(allowed)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    imported = {normal(dist) for dists in json.loads(done.stdout).values() for dist in dists}
    assert set(pins()) <= imported, f"carried but never imported: {sorted(set(pins()) - imported)}"


def test_run_stops_at_once_without_the_wheels(tmp_path):
    (tmp_path / "bench").mkdir()
    shutil.copy(ROOT / "bench/gpu_run.sh", tmp_path / "bench")
    env = {k: v for k, v in os.environ.items() if k != "ZQ_NO_WHEELS"} | {"OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", tmp_path / "bench/gpu_run.sh"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "make gpu-wheels" in done.stderr


@pytest.mark.slow
def test_run_dry_on_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "ZQ_NO_WHEELS": "1", "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "bench/gpu_run.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    env_txt = (tmp_path / "env.txt").read_text()
    assert "== packages (bench/gpu_imports.py)" in env_txt and "structlog" in env_txt
    assert "== gpu_check: exit 0" in env_txt
    assert json.loads((tmp_path / "gpu_check.json").read_text())["mode"].startswith("dry-run")
