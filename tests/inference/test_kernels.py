"""The CPU kernels (services/inference/device/kernels) against torch references, and their batch invariance."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from services.inference.device import kernels

DTYPES = (torch.float32, torch.bfloat16)
FEW = settings(max_examples=12, deadline=None, derandomize=True)


@pytest.fixture(scope="module")
def ops() -> kernels.CpuOps:
    loaded = kernels.load_cpu_ops()
    if loaded is not None:
        return loaded
    reason = kernels.reason_unavailable()
    # A CPU that has the ISA must get working kernels: a build failure there is a defect, not a skip.
    capable = kernels.choose_isa()[0] is not None and os.environ.get(kernels.DISABLE_ENV) != "1"
    if os.environ.get("ZQ_REQUIRE_KERNELS") == "1" or capable:
        pytest.fail(f"CPU kernels unavailable: {reason}")
    pytest.skip(f"CPU kernels unavailable: {reason}")


@pytest.fixture(scope="module", params=kernels.BF16_PATHS)
def linear_ops(ops, request) -> kernels.CpuOps:
    """Every bf16 path of the linear kernel this CPU runs, whichever it picked: each must be right on its own."""
    if request.param not in ops.bf16_paths:
        pytest.skip(f"the {ops.isa} build has no {request.param} path")
    if request.param == "amx" and not kernels.amx_available():
        pytest.skip("this CPU has no AMX tiles")
    return dataclasses.replace(ops, bf16_path=kernels.BF16_PATHS.index(request.param))


@contextlib.contextmanager
def num_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---- linear ----


@FEW
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 100),
    k=st.one_of(st.integers(1, 90), st.sampled_from([32, 64, 96])),
    dtype=st.sampled_from(DTYPES),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_matches_f_linear(linear_ops, m, n, k, dtype, with_bias, seed):
    """k in whole tiles of 32 as well as any k: the AMX path takes the former, the widening path the rest."""
    x, w = randn(m, k, dtype=dtype, seed=seed), randn(n, k, dtype=dtype, seed=seed + 1)
    bias = randn(n, dtype=dtype, seed=seed + 2) if with_bias else None
    y = linear_ops.linear(x, linear_ops.pack_linear(w), bias, n)
    # fp32 math on the same (already rounded) inputs: the kernel only adds fp32 accumulation error.
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert y.dtype == dtype and y.shape == (m, n)
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * math.sqrt(k))
    else:  # one rounding to bf16 at the end (2^-8 relative), plus fp32 accumulation
        torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-4 * math.sqrt(k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,m", [(21, 3), (64, 3), (64, 20)])
def test_linear_bias_lands_on_its_own_column(linear_ops, dtype, k, m):
    w, bias = randn(35, k, dtype=dtype, seed=2), randn(35, dtype=dtype, seed=3)  # 35: three panels, last partial
    y = linear_ops.linear(torch.zeros(m, k, dtype=dtype), linear_ops.pack_linear(w), bias, 35)
    assert torch.equal(y, bias.expand(m, -1))


BF16_EDGES = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    float("inf"),
    float("-inf"),
    float("nan"),
    3.3895e38,
    -3.3895e38,
    1.1755e-38,
    9.1835e-41,
    -9.1835e-41,
    1.00390625,
    1.01171875,
    2.0**-126,
    2.0**100,
    2.0**-100,
]


def test_linear_rounds_to_bf16_as_torch_does(ops):
    """k = 1: y[m, n] = x[m] * w[n] exactly in fp32 (bf16 products have at most 16 significant bits), then one
    rounding to bf16: nearest even on ties, overflow to inf, NaN kept NaN; denormals kept in the AVX2 build,
    flushed to zero by the AVX-512 build's VCVTNEPS2BF16 (as the SDM specifies it)."""
    edges = torch.tensor(BF16_EDGES).to(torch.bfloat16)
    x = torch.cat([edges, randn(200, dtype=torch.bfloat16, seed=30) * 8]).unsqueeze(1)
    w = torch.cat([edges, randn(90, dtype=torch.bfloat16, seed=31)]).unsqueeze(1)
    widen = dataclasses.replace(ops, bf16_path=0)  # VDPBF16PS and AMX take denormal inputs as zero
    y = widen.linear(x, widen.pack_linear(w), None, w.shape[0])
    exact = x.float() * w.float().T
    denormal = (exact.abs() < 2.0**-126) & (exact != 0)
    assert denormal.any()
    ref = exact.to(torch.bfloat16)
    if ops.isa == "avx512":
        ref = ref.masked_fill(denormal, 0.0)
    assert torch.equal(y.isnan(), ref.isnan())
    finite = dict(nan=0.0, posinf=math.inf, neginf=-math.inf)
    assert torch.equal(y.nan_to_num(**finite), ref.nan_to_num(**finite))  # +0 == -0: a sum's sign of zero
    ties = exact.view(torch.int32) & 0xFFFF == 0x8000
    assert ties.sum() > 100  # the random products hit round-half-even


def test_linear_keeps_leading_dims(ops):
    x, w = randn(2, 5, 24, dtype=torch.float32, seed=4), randn(40, 24, dtype=torch.float32, seed=5)
    y = ops.linear(x, ops.pack_linear(w), None, 40)
    torch.testing.assert_close(y, F.linear(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(960, 576), (37, 64), (37, 33), (16, 1)])
def test_linear_is_batch_invariant(linear_ops, dtype, n, k):
    """A row's output is bit-identical alone, in any batch, in any order, on any number of threads."""
    x, w = randn(45, k, dtype=dtype, seed=6), randn(n, k, dtype=dtype, seed=7)
    bias = randn(n, dtype=dtype, seed=8)
    packed = linear_ops.pack_linear(w)
    full = linear_ops.linear(x, packed, bias, n)
    for m in range(0, 45, 7):
        assert torch.equal(linear_ops.linear(x[m : m + 1], packed, bias, n), full[m : m + 1])
    for size in (2, 5, 8, 9, 33):
        assert torch.equal(linear_ops.linear(x[:size], packed, bias, n), full[:size])
    order = torch.randperm(45, generator=torch.Generator().manual_seed(9))
    assert torch.equal(linear_ops.linear(x[order], packed, bias, n), full[order])
    with num_threads(1):
        assert torch.equal(linear_ops.linear(x, packed, bias, n), full)


def test_the_bf16_paths_agree_to_fp32_rounding(linear_ops, ops):
    x, w = randn(33, 576, dtype=torch.bfloat16, seed=13), randn(1536, 576, dtype=torch.bfloat16, seed=14)
    packed = ops.pack_linear(w)
    widen = dataclasses.replace(ops, bf16_path=0).linear(x, packed, None, 1536)
    other = linear_ops.linear(x, packed, None, 1536)
    # the same exact products summed in another order: at most a bf16 rounding apart, mostly equal
    torch.testing.assert_close(other, widen, rtol=2**-7, atol=1e-3)
    assert (other == widen).float().mean() > 0.9


def test_the_bf16_path_is_measured_or_forced(ops, monkeypatch):
    if "dot" not in ops.bf16_paths:
        pytest.skip(f"the {ops.isa} build has only the widening path: test_avx2_build_widens_whatever_is_asked")
    rate = torch.ops.zeroqueue.bf16_dot_rate.default()
    assert 0.05 < rate < 20  # an issue-rate ratio, not a failed timing
    for name in ("widen", "dot"):
        monkeypatch.setenv(kernels.BF16_PATH_ENV, name)
        assert kernels.BF16_PATHS[kernels.choose_bf16_path(kernels.AVX512)] == name
    monkeypatch.setenv(kernels.BF16_PATH_ENV, "amx")  # forced, but only where the CPU has it
    assert kernels.BF16_PATHS[kernels.choose_bf16_path(kernels.AVX512)] == "amx" or not kernels.amx_available()
    monkeypatch.delenv(kernels.BF16_PATH_ENV)
    chosen = kernels.BF16_PATHS[kernels.choose_bf16_path(kernels.AVX512)]
    if kernels.amx_available():
        assert chosen == "amx"
    else:
        dot = torch.ops.zeroqueue.bf16_dot_rate.default() > kernels.DOT_RATE_THRESHOLD
        assert chosen == ("dot" if dot else "widen") or abs(rate - kernels.DOT_RATE_THRESHOLD) < 0.1


def test_the_int_path_is_the_builds_first_unless_forced(ops, monkeypatch):
    """VNNI's quads first on both builds (VPDPBUSD on AVX-512, VPMADDUBSW on AVX2); ZQ_LINEAR_INT forces one the build
    has, and an unknown or missing name falls back to the build's first. The loaded ops pack for the path they took."""
    assert kernels.AVX512.int_paths == kernels.AVX2.int_paths == ("vnni", "convert")
    monkeypatch.delenv(kernels.INT_PATH_ENV, raising=False)
    assert kernels.choose_int_path(kernels.AVX512) == "vnni" and kernels.choose_int_path(kernels.AVX2) == "vnni"
    monkeypatch.setenv(kernels.INT_PATH_ENV, "convert")
    assert kernels.choose_int_path(kernels.AVX512) == "convert" and kernels.choose_int_path(kernels.AVX2) == "convert"
    for name in ("amx", "VNNI", ""):
        monkeypatch.setenv(kernels.INT_PATH_ENV, name)
        assert kernels.choose_int_path(kernels.AVX2) == "vnni"
    assert ops.int_path in kernels.isa_named(ops.isa).int_paths
    q = torch.randint(-127, 128, (40, 24), dtype=torch.int8)
    assert ops.pack_int8(q).shape == ((3, 6, 16, 4) if ops.int_path == "vnni" else (3, 12, 16, 2))


def test_avx2_build_widens_whatever_is_asked(ops, monkeypatch):
    """No VDPBF16PS, no AMX: the choice is the widening path even when forced, and linear refuses the others."""
    if ops.isa != "avx2":
        pytest.skip(f"the {ops.isa} build has every path")
    assert ops.bf16_paths == ("widen",) and ops.bf16_path_name == "widen"
    assert torch.ops.zeroqueue.bf16_dot_rate.default() == 0.0
    assert not torch.ops.zeroqueue.amx_request.default() and not kernels.amx_available()
    for name in kernels.BF16_PATHS:
        monkeypatch.setenv(kernels.BF16_PATH_ENV, name)
        assert kernels.choose_bf16_path(kernels.AVX2) == kernels.BF16_PATHS.index("widen")
    x, w = randn(2, 64, dtype=torch.bfloat16, seed=10), randn(16, 64, dtype=torch.bfloat16, seed=11)
    for path in (1, 2):
        with pytest.raises(RuntimeError, match="needs the AVX-512 build"):
            torch.ops.zeroqueue.linear.default(x, ops.pack_linear(w), None, 16, path)


def test_amx_is_offered_only_with_the_cpu_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu avx512f amx_tile\n")
    assert kernels.missing_cpu_flags(cpuinfo, kernels.AMX_CPU_FLAGS) == ("amx_bf16",)


def test_pack_linear_layout(ops):
    w = randn(20, 7, dtype=torch.bfloat16, seed=10)
    packed = ops.pack_linear(w)
    assert packed.shape == (2, 4, 16, 2)  # [ceil(N/16)][ceil(K/2)][16][2]
    n, k = torch.meshgrid(torch.arange(20), torch.arange(7), indexing="ij")
    assert torch.equal(packed[n // 16, k // 2, n % 16, k % 2], w)
    assert packed.float().abs().sum() == w.float().abs().sum()  # padding is zero
    w32 = w.float()
    packed32 = ops.pack_linear(w32)
    assert packed32.shape == (2, 7, 16)  # [ceil(N/16)][K][16]
    assert torch.equal(packed32[n // 16, k, n % 16], w32)


def test_linear_rejects_mismatched_inputs(ops):
    packed = ops.pack_linear(randn(32, 16, dtype=torch.float32, seed=11))
    with pytest.raises(RuntimeError, match="was not packed for K=17"):
        ops.linear(randn(2, 17, dtype=torch.float32, seed=12), packed, None, 32)
    with pytest.raises(RuntimeError, match="n=40 does not match"):
        ops.linear(randn(2, 16, dtype=torch.float32, seed=12), packed, None, 40)
    with pytest.raises(RuntimeError, match="x is BFloat16 but packed is Float"):
        ops.linear(randn(2, 16, dtype=torch.bfloat16, seed=12), packed, None, 32)


# ---- registration and CPU detection ----


def test_missing_cpu_flags_reads_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512bw avx512vl avx512dq fma avx2\n")
    assert kernels.missing_cpu_flags(cpuinfo) == ("avx512_bf16", "avx512_vnni")
    assert kernels.missing_cpu_flags(tmp_path / "absent") == kernels.AVX512.cpu_flags
