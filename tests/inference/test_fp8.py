"""FP8 weights for CUDA devices (issue 34): the E4M3 per-channel quantization, Fp8Linear's product against bf16 (on
the CPU, where torch._scaled_mm also runs), its ops all on the device with fake CUDA tensors (no GPU needed, as
test_sampling.py's), and a replica that refuses fp8 where no device has it. On a GPU, bench/gpu_check.py's fp8 part
measures parity and speed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from services.inference.device.quant import FP8_MAX, Fp8Linear, fp8_layers, quantize_fp8
from tests.inference.conftest import make_engine
from tests.inference.test_sampling import DeviceCopies


def test_quantize_fp8_keeps_each_weight_within_e4m3s_rounding():
    w = torch.randn(48, 64) * torch.linspace(0.01, 4, 48)[:, None]
    w[5] = 0
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (48,) and scale[5] == 1
    assert torch.isclose(q.float().abs().amax(dim=1)[scale != 1], torch.tensor(FP8_MAX)).all()
    err = (q.float() * scale[:, None] - w).abs()
    # 3 mantissa bits: half an ulp is 1/16 of the value, and the smallest subnormal step is 2^-9 of the scale
    assert (err <= w.abs() / 16 + scale[:, None] * 2**-9).all()


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_is_near_the_bf16_product_and_keeps_its_shape(bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias).to(torch.bfloat16)
    fp8 = Fp8Linear(linear)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    y, ref = fp8(x), linear(x)
    assert y.shape == (2, 5, 48) and y.dtype == torch.bfloat16
    assert ((y.float() - ref.float()).abs().max() / ref.float().abs().max()) < 0.1
    # each row's scale is its own: a row gives the same output alone as in the batch
    assert torch.equal(fp8(x[0, :1]), y[0, :1])


def test_fp8_linear_stays_on_the_device_with_no_host_copy():
    with FakeTensorMode():
        # a linear layer's weight and bias on the device (nn.Linear's own init would need a real CUDA generator)
        weight, bias = (torch.empty(*size, device="cuda", dtype=torch.bfloat16) for size in ((48, 64), (48,)))
        with DeviceCopies() as seen:
            fp8 = Fp8Linear(SimpleNamespace(weight=weight, bias=bias))
            y = fp8(torch.empty(7, 64, dtype=torch.bfloat16, device="cuda"))
    assert y.device.type == "cuda" and y.dtype == torch.bfloat16 and y.shape == (7, 48)
    assert "aten._scaled_mm" in seen.device_ops and seen.to_host == 0, seen.device_ops


def test_fp8_layers_swaps_every_linear_and_refuses_sizes_tensor_cores_do_not_take():
    layers = nn.ModuleList([nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)) for _ in range(2)])
    assert fp8_layers(layers) == 4 and all(isinstance(layers[i][j], Fp8Linear) for i in (0, 1) for j in (0, 2))
    with pytest.raises(ValueError, match=r"multiples of 16, not \[33, 64\]"):
        Fp8Linear(nn.Linear(64, 33))


def test_a_cpu_replica_refuses_fp8(llama_dir):
    with pytest.raises(ValueError, match="fp8 needs a CUDA device of compute capability 8.9"):
        make_engine(llama_dir, dtype="bfloat16", quantize="fp8")
