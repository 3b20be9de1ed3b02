"""GPU facts from NVML, and the CUDA device description, against a fake pynvml: no GPU or driver needed."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from structlog.testing import capture_logs

from services.inference.device.executor import Device, describe_device
from services.inference.device.nvml import GpuFacts, gpu_facts
from tests.inference.fake_nvml import A100, DRIVER, H100, SLICE, Dev, install, mig_host


def test_plain_gpu_matched_without_prefix_and_bytes_decoded(monkeypatch):
    gpus = [Dev(H100.encode(), mig=False), Dev(A100.encode(), name=b"NVIDIA A100-SXM4-40GB", memory=40 << 30)]
    fake = install(monkeypatch, gpus)
    fake.nvmlSystemGetDriverVersion = lambda: DRIVER.encode()
    assert gpu_facts(A100.removeprefix("GPU-")) == GpuFacts(
        A100, "NVIDIA A100-SXM4-40GB", False, False, DRIVER, 40 << 30
    )
    assert fake.calls[-1] == "nvmlShutdown"


@pytest.mark.parametrize("torch_uuid", [SLICE, SLICE.removeprefix("MIG-")])
def test_mig_slice_has_parent_name_and_slice_memory(monkeypatch, torch_uuid):
    fake = install(monkeypatch, mig_host())
    assert gpu_facts(torch_uuid) == GpuFacts(SLICE, "NVIDIA H100 80GB HBM3", True, True, DRIVER, 20 << 30)
    assert fake.calls.count("nvmlDeviceGetMigDeviceHandleByIndex") == 3  # the empty slot was skipped
    assert fake.calls[-1] == "nvmlShutdown"


def test_plain_gpu_beside_a_mig_gpu(monkeypatch):
    install(monkeypatch, mig_host())
    assert gpu_facts(A100) == GpuFacts(A100, "NVIDIA A100-SXM4-40GB", False, False, DRIVER, 40 << 30)


def test_no_match(monkeypatch):
    fake = install(monkeypatch, mig_host())
    assert gpu_facts("GPU-00000000-0000-0000-0000-000000000000") is None
    assert fake.calls[-1] == "nvmlShutdown"


@pytest.mark.parametrize(
    "failing",
    [
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetMaxMigDeviceCount",
        "nvmlDeviceGetName",
        "nvmlSystemGetDriverVersion",
        "nvmlDeviceGetMemoryInfo",
    ],
)
def test_error_after_init_gives_none_and_shuts_down(monkeypatch, failing):
    fake = install(monkeypatch, mig_host(), fail=(failing,))
    with capture_logs() as logs:
        assert gpu_facts(SLICE) is None
    assert fake.calls[-1] == "nvmlShutdown"
    assert [(e["log_level"], e["error"]) for e in logs] == [("warning", f"{failing}: Unknown Error")]


def test_error_from_shutdown_does_not_escape(monkeypatch):
    install(monkeypatch, mig_host(), fail=("nvmlShutdown",))
    with capture_logs() as logs:
        assert gpu_facts(A100) == GpuFacts(A100, "NVIDIA A100-SXM4-40GB", False, False, DRIVER, 40 << 30)
    assert [(e["log_level"], e["error"]) for e in logs] == [("warning", "nvmlShutdown: Unknown Error")]


def test_errors_from_query_and_shutdown(monkeypatch):
    install(monkeypatch, mig_host(), fail=("nvmlDeviceGetMemoryInfo", "nvmlShutdown"))
    with capture_logs() as logs:
        assert gpu_facts(A100) is None
    assert [e["error"] for e in logs] == ["nvmlDeviceGetMemoryInfo: Unknown Error", "nvmlShutdown: Unknown Error"]


def test_no_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    assert gpu_facts(A100) is None


def test_init_fails(monkeypatch):
    fake = install(monkeypatch, mig_host(), fail=("nvmlInit",))
    assert gpu_facts(A100) is None
    assert fake.calls == ["nvmlInit"]  # nothing to shut down


def cuda_props(monkeypatch, uuid: str, name: str = "NVIDIA H100 80GB HBM3") -> None:
    props = SimpleNamespace(uuid=uuid, name=name, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)


CUDA0 = torch.device("cuda", 0)


def test_describe_cuda_with_nvml(monkeypatch):
    install(monkeypatch, mig_host())
    cuda_props(monkeypatch, A100.removeprefix("GPU-"), name="torch's name")
    assert describe_device(CUDA0) == Device("cuda", "NVIDIA A100-SXM4-40GB", A100, 132, "sm_us")


def test_describe_cuda_mig_slice_with_nvml(monkeypatch):
    install(monkeypatch, mig_host())
    cuda_props(monkeypatch, SLICE.removeprefix("MIG-"), name="NVIDIA H100 80GB HBM3 MIG 3g.40gb")
    assert describe_device(CUDA0) == Device("cuda", "NVIDIA H100 80GB HBM3", SLICE, 132, "sm_us")


@pytest.mark.parametrize(("torch_uuid", "device_id"), [(H100.removeprefix("GPU-"), H100), (H100, H100), (SLICE, SLICE)])
def test_describe_cuda_without_nvml(monkeypatch, torch_uuid, device_id):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    cuda_props(monkeypatch, torch_uuid, name="torch's name")
    assert describe_device(CUDA0) == Device("cuda", "torch's name", device_id, 132, "sm_us")


def test_describe_a_mig_slice_without_nvml_by_its_cuda_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    cuda_props(monkeypatch, SLICE.removeprefix("MIG-"), name="NVIDIA H100 80GB HBM3 MIG 3g.40gb")
    assert describe_device(CUDA0) == Device("cuda", "NVIDIA H100 80GB HBM3 MIG 3g.40gb", SLICE, 132, "sm_us")


def test_describe_cuda_when_nvml_fails_after_init(monkeypatch):
    install(monkeypatch, mig_host(), fail=("nvmlDeviceGetCount",))
    cuda_props(monkeypatch, A100.removeprefix("GPU-"), name="torch's name")
    assert describe_device(CUDA0) == Device("cuda", "torch's name", A100, 132, "sm_us")
