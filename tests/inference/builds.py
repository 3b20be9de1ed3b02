"""Run a kernel check in a child process that loads another build of the kernels (ZQ_KERNELS_ISA), so the AVX2
build is tested on an AVX-512 host too: the kernels' build is chosen once a process."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from services.inference.device import kernels
from services.inference.device.quant import quantize_rows_int8

ROOT = Path(__file__).resolve().parents[2]


def check_in_build(isa: str, loaded: str, module: str, check: str) -> int:
    """`module`.`check`(isa) (returning how many cases it checked) in a child that loads the build `isa`; skips
    where that is the build this process `loaded` (its own tests ran it) or one this CPU cannot run."""
    if isa == loaded:
        pytest.skip(f"{isa} is the build this process loaded: the tests above ran it")
    if isa not in {runnable.name for runnable in kernels.runnable_isas()[0]}:
        pytest.skip(f"this CPU does not run the {isa} build")
    env = {**os.environ, kernels.ISA_ENV: isa, "PYTHONPATH": str(ROOT)}
    code = f"from tests.inference.builds import loaded_isa; from {module} import {check}; i = loaded_isa(); "
    code += f"print(i, {check}(i))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    name, count = done.stdout.split()
    assert name == isa
    return int(count)


def loaded_isa() -> str:
    loaded = kernels.load_cpu_ops()
    assert loaded is not None, kernels.reason_unavailable()
    return loaded.isa


def use_int_path(monkeypatch, path: str) -> None:
    """The engines built from now on in this test take int8 path `path` (CpuOps.int_path), skipped where the loaded
    build lacks it."""
    ops = kernels.load_cpu_ops()
    if path not in kernels.isa_named(ops.isa).int_paths:
        pytest.skip(f"the {ops.isa} build has no {path} int8 path")
    monkeypatch.setattr(kernels, "load_cpu_ops", lambda: dataclasses.replace(ops, int_path=path))


def quantize_inputs(model: nn.Module) -> None:
    """Every nn.Linear of `model` sees its input as the VNNI path multiplies it: each row quantized to int8
    (quant.quantize_rows_int8) and scaled back."""

    def quantized(_module, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        q, scale = quantize_rows_int8(x)
        return ((q.float() * scale[:, None]).to(x.dtype).reshape(args[0].shape),)

    for linear in (m for m in model.modules() if isinstance(m, nn.Linear)):
        linear.register_forward_pre_hook(quantized)
