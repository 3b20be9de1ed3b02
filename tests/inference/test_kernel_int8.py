"""zeroqueue::linear_int8 (kernels/linear_int8.cpp, issue 34) against a plain-torch product of the same int8 weights
and scales, at every linear shape of the bundled model and the SmolLM2-135M shape and at ragged ones, for ragged
batches, on both layouts (bf16-layout pairs; VNNI quads, whose rows of x are quantized, against
quant.linear_int8_vnni_reference); and its batch invariance. The build this process loaded runs here; every other
build this CPU runs is checked in a child process that loads it (ZQ_KERNELS_ISA), so the AVX2 build (its quads on
VPMADDUBSW) is tested on an AVX-512 host too."""

from __future__ import annotations

import pytest
import torch

from services.inference.device import kernels
from services.inference.device.quant import linear_int8_vnni_reference, pack_int8_vnni, quantize_int8
from tests.inference.builds import check_in_build
from tests.inference.test_kernels import ops  # noqa: F401 - the fixture: the loaded build, or why not

# (N, K): the SmolLM2-135M shape's qkv, o, gate_up, down; the bundled model's are among the ragged ones' kind
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (17, 33), (48, 64), (1, 7), (130, 256))
ROWS = (1, 2, 7, 8, 9, 32, 70)  # 70: above kDirectRows, the buffered path


def cases_of(isa: str) -> list[tuple[str, torch.dtype, int]]:
    """(layout, x dtype, bf16 path) of every product check_int8 runs on the build `isa`: pairs with fp32 x and with
    bf16 x on each bf16 path (amx meaning VDPBF16PS for int8); VNNI quads with fp32 and bf16 x where it has them."""
    build = kernels.isa_named(isa)
    pairs = [("convert", torch.float32, 0)] + [("convert", torch.bfloat16, p) for p in range(len(build.bf16_paths))]
    quads = [("vnni", dtype, 0) for dtype in (torch.float32, torch.bfloat16)] if "vnni" in build.int_paths else []
    return pairs + quads


def reference(layout: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias) -> torch.Tensor:
    if layout == "vnni":
        return linear_int8_vnni_reference(x.float(), q, scale, bias)
    return (x.float() @ q.float().T) * scale + (0 if bias is None else bias)


def check_int8(isa: str, seed: int = 0) -> int:
    """Every shape and batch against the reference, in every case of cases_of(isa); raises AssertionError on the
    first that differs. Returns how many products were checked."""
    gen, checked = torch.Generator().manual_seed(seed), 0
    for n, k in SHAPES:
        q, scale = quantize_int8(torch.randn(n, k, generator=gen) * 0.02)
        q[0, :5] = -128  # never made here, but a pre-quantized checkpoint may hold it (the AVX2 quads take |q|)
        packed = {"convert": torch.ops.zeroqueue.pack_linear(q), "vnni": pack_int8_vnni(q)}
        assert packed["convert"].dtype == torch.int8 and packed["convert"].shape == (-(-n // 16), -(-k // 2), 16, 2)
        assert packed["vnni"].dtype == torch.int8 and packed["vnni"].shape == (-(-n // 16), -(-k // 4), 16, 4)
        for bias in (None, torch.randn(n, generator=gen)):
            for m in ROWS:
                for layout, dtype, path in cases_of(isa):
                    x = torch.randn(m, k, generator=gen).to(dtype)
                    x[m // 2] = 0  # a row of zeros: VNNI's factor for it is 0, its output the bias
                    y = torch.ops.zeroqueue.linear_int8(x, packed[layout], scale, bias, n, path)
                    ref = reference(layout, x, q, scale, bias)
                    assert y.dtype == dtype and y.shape == (m, n)
                    # fp32: the same products summed in another order; bf16: the output's rounding
                    tol = 1e-5 if dtype == torch.float32 else 8e-3
                    err = ((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
                    what = f"N={n} K={k} M={m} {layout} {dtype} path {path} bias={bias is not None}"
                    assert err < tol, f"{what}: error {err:.2e}"
                    for r in {0, m - 1}:  # a row alone is the same row in the batch, bit for bit
                        alone = torch.ops.zeroqueue.linear_int8(x[r : r + 1], packed[layout], scale, bias, n, path)
                        assert torch.equal(alone, y[r : r + 1]), f"{what}: row {r} moved"
                    checked += 1
    return checked


def test_int8_linear_matches_the_reference_and_is_batch_invariant(ops):  # noqa: F811
    assert check_int8(ops.isa) == len(SHAPES) * 2 * len(ROWS) * len(cases_of(ops.isa))


def test_int8_linear_refuses_what_it_was_not_packed_for(ops):  # noqa: F811
    q, scale = quantize_int8(torch.randn(40, 24))
    packed = torch.ops.zeroqueue.pack_linear(q)
    x = torch.randn(3, 24)
    with pytest.raises(RuntimeError, match="is neither pack_linear's int8 pairs nor VNNI quads for K=25"):
        torch.ops.zeroqueue.linear_int8(torch.randn(3, 25), packed, scale, None, 40)
    with pytest.raises(RuntimeError, match="nor VNNI quads for K=28"):  # quads of K = 24 cover 21..24
        torch.ops.zeroqueue.linear_int8(torch.randn(3, 28), pack_int8_vnni(q), scale, None, 40)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.zeroqueue.linear_int8(x, packed, scale, None, 60)
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.zeroqueue.linear_int8(x, packed, scale[:-1], None, 40)
    with pytest.raises(RuntimeError, match="is neither pack_linear's int8 pairs"):
        torch.ops.zeroqueue.linear_int8(x, torch.ops.zeroqueue.pack_linear(q.float()), scale, None, 40)
    with pytest.raises(RuntimeError, match="is neither pack_linear's int8 pairs"):  # int4's nibbles are not int8
        torch.ops.zeroqueue.linear_int8(x, pack_int8_vnni(q).view(torch.uint8), scale, None, 40)
    assert torch.ops.zeroqueue.linear_int8(x[:0], packed, scale, None, 40).shape == (0, 40)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_int8_linear_on_every_build_this_cpu_runs(ops, isa):  # noqa: F811
    checked = check_in_build(isa, ops.isa, "tests.inference.test_kernel_int8", "check_int8")
    assert checked == len(SHAPES) * 2 * len(ROWS) * len(cases_of(isa))
