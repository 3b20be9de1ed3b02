"""zeroqueue::linear_int4 (kernels/linear_int4.cpp, issue 34) against a plain-torch product of the same int4 weights
and group scales, at every linear shape of the bundled model and the SmolLM2-135M shape and at ragged ones (a K that
ends inside a group, an odd K, N not a multiple of 16), for ragged batches on every path and both layouts (pack_int4's;
pack_int4_vnni's, whose rows of x are quantized, against quant.linear_int4_vnni_reference); its batch invariance; and
the packings and the quantization (quant.quantize_int4) it reads. The build this process loaded runs
here; every other build this CPU runs is checked in a child process that loads it (ZQ_KERNELS_ISA)."""

from __future__ import annotations

import pytest
import torch

from services.inference.device import kernels
from services.inference.device.quant import (
    INT4_GROUP,
    dequantize_int4,
    linear_int4_vnni_reference,
    pack_int4,
    pack_int4_vnni,
    quantize_int4,
)
from tests.inference.builds import check_in_build
from tests.inference.test_kernels import ops  # noqa: F401 - the fixture: the loaded build, or why not

# (N, K, group): the SmolLM2-135M shape's qkv, o, gate_up, down; the bundled model's kind; ragged ones
SHAPES = (
    (960, 576, 64),
    (576, 576, 64),
    (3072, 576, 64),
    (576, 1536, 64),
    (768, 256, 64),
    (17, 33, 32),
    (48, 100, 64),
    (1, 7, 4),
    (130, 256, 128),
)
ROWS = (1, 3, 4, 5, 9, 32)


def cases_of(isa: str) -> list[tuple[str, torch.dtype, int]]:
    """(layout, x dtype, bf16 path) of every product check_int4 runs on the build `isa`: pack_int4's with fp32 x and
    with bf16 x on each bf16 path; VNNI's with fp32 and bf16 x where the build has it."""
    build = kernels.isa_named(isa)
    nibbles = [("convert", torch.float32, 0)] + [("convert", torch.bfloat16, p) for p in range(len(build.bf16_paths))]
    quads = [("vnni", dtype, 0) for dtype in (torch.float32, torch.bfloat16)] if "vnni" in build.int_paths else []
    return nibbles + quads


def check_int4(isa: str, seed: int = 0) -> int:
    """Every shape and batch against the reference, in every case of cases_of(isa) (VNNI: the shapes whose group it
    holds, a multiple of 16 inputs); raises AssertionError on the first that differs. Returns how many products were
    checked."""
    gen, checked = torch.Generator().manual_seed(seed), 0
    for n, k, group in SHAPES:
        q, scale = quantize_int4(torch.randn(n, k, generator=gen) * 0.02, group)
        packed = {"convert": pack_int4(q, scale, group)}
        if group % 16 == 0:
            packed["vnni"] = pack_int4_vnni(q, scale, group)
        w = dequantize_int4(q, scale, torch.float32, group)
        for bias in (None, torch.randn(n, generator=gen)):
            for m in ROWS:
                for layout, dtype, path in (case for case in cases_of(isa) if case[0] in packed):
                    x = torch.randn(m, k, generator=gen).to(dtype)
                    x[m // 2] = 0  # a row of zeros: VNNI's factor for it is 0, its output the bias
                    y = torch.ops.zeroqueue.linear_int4(x, *packed[layout], bias, n, path)
                    if layout == "vnni":
                        ref = linear_int4_vnni_reference(x.float(), q, scale, group, bias)
                    else:
                        ref = (x.double() @ w.double().T + (0 if bias is None else bias.double())).float()
                    assert y.dtype == dtype and y.shape == (m, n)
                    # fp32: the same products summed in another order; bf16: the output's rounding
                    tol = 1e-5 if dtype == torch.float32 else 8e-3
                    err = ((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
                    what = f"N={n} K={k} M={m} {layout} {dtype} path {path} bias={bias is not None}"
                    assert err < tol, f"{what}: error {err:.2e}"
                    for r in {0, m - 1}:  # a row alone is the same row in the batch, bit for bit
                        alone = torch.ops.zeroqueue.linear_int4(x[r : r + 1], *packed[layout], bias, n, path)
                        assert torch.equal(alone, y[r : r + 1]), f"{what}: row {r} moved"
                    checked += 1
    return checked


def expected_checks(isa: str) -> int:
    vnni_shapes = sum(group % 16 == 0 for _, _, group in SHAPES)
    return 2 * len(ROWS) * sum(vnni_shapes if case[0] == "vnni" else len(SHAPES) for case in cases_of(isa))


def test_int4_linear_matches_the_reference_and_is_batch_invariant(ops):  # noqa: F811
    assert check_int4(ops.isa) == expected_checks(ops.isa)


def test_int4_linear_refuses_what_it_was_not_packed_for(ops):  # noqa: F811
    packed, scales = pack_int4(*quantize_int4(torch.randn(40, 128), 64), 64)
    x = torch.randn(3, 128)
    with pytest.raises(RuntimeError, match="has K=200"):
        torch.ops.zeroqueue.linear_int4(torch.randn(3, 200), packed, scales, None, 40)
    with pytest.raises(RuntimeError, match="has K=64"):  # a whole group short
        torch.ops.zeroqueue.linear_int4(torch.randn(3, 64), packed, scales, None, 40)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.zeroqueue.linear_int4(x, packed, scales, None, 60)
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.zeroqueue.linear_int4(x, packed, scales[:, :1, :8].contiguous(), None, 40)
    with pytest.raises(RuntimeError, match="groups dividing"):
        torch.ops.zeroqueue.linear_int4(x, packed, torch.ones(3, 3, 16), None, 40)
    with pytest.raises(RuntimeError, match="pack_int4.s uint8"):
        torch.ops.zeroqueue.linear_int4(x, packed.to(torch.int8), scales, None, 40)
    quads, quad_scales = pack_int4_vnni(*quantize_int4(torch.randn(40, 128), 64), 64)
    with pytest.raises(RuntimeError, match="has K=200"):
        torch.ops.zeroqueue.linear_int4(torch.randn(3, 200), quads, quad_scales, None, 40)
    with pytest.raises(RuntimeError, match="VNNI groups must hold a multiple of 16 inputs, not 8"):
        torch.ops.zeroqueue.linear_int4(torch.randn(3, 8), quads[:, :1].contiguous(), torch.ones(3, 1, 16), None, 40)
    assert torch.ops.zeroqueue.linear_int4(x[:0], packed, scales, None, 40).shape == (0, 40)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_int4_linear_on_every_build_this_cpu_runs(ops, isa):  # noqa: F811
    checked = check_in_build(isa, ops.isa, "tests.inference.test_kernel_int4", "check_int4")
    assert checked == expected_checks(isa)


def test_quantize_int4_uses_sixteen_levels_per_group_and_round_trips():
    w = torch.tensor([[0.0] * 4 + [0.5, -1.0, 0.25, 0.9], [2.0, -1.0, 0.0, 0.5] + [0.0] * 4])
    q, scale = quantize_int4(w, group=4)
    # a group of zeros gets scale 1; a group's largest magnitude maps to -8 (so the scale takes the opposite sign)
    assert scale.tolist() == [[1.0, 0.125], [-0.25, 1.0]]
    assert q.tolist() == [[0, 0, 0, 0, 4, -8, 2, 7], [-8, 4, 0, -2, 0, 0, 0, 0]]
    back = dequantize_int4(q, scale, torch.float32, 4)
    assert back[1].tolist() == [2.0, -1.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0]
    assert (back - w).abs().max() <= 0.125 / 2  # within half a level
    ints, _ = quantize_int4(torch.randn(64, 96), group=32)
    assert ints.dtype == torch.int8 and int(ints.min()) == -8 and int(ints.max()) <= 7


def test_quantize_int4_refuses_a_group_the_kernel_cannot_step_through():
    for group in (2, 6):
        with pytest.raises(ValueError, match="multiple of 4"):
            quantize_int4(torch.randn(4, 8), group=group)


def test_pack_int4_puts_four_inputs_of_a_column_in_two_bytes():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 1)[:, :6]  # [3, 6]: -8..-3 in every row
    q[1] = torch.tensor([7, 6, 5, 4, 3, 2], dtype=torch.int8)
    packed, scales = pack_int4(q, torch.full((3, 2), 0.5), group=4)
    assert packed.shape == (1, 2, 16, 2) and packed.dtype == torch.uint8  # K 6 padded to two groups of 4
    # + 8: row 0 is 0..5; step 0's bytes are w0 | w2 << 4 and w1 | w3 << 4; step 1 pads w6, w7 with zeros (8)
    assert packed[0, :, 0].tolist() == [[0x20, 0x31], [0x84, 0x85]]
    assert packed[0, :, 1].tolist() == [[0xDF, 0xCE], [0x8B, 0x8A]]  # 15, 14, 13, 12 | 11, 10
    assert (packed[0, :, 3:] == 0x88).all()  # columns past N
    assert scales.shape == (1, 2, 16) and scales[0, :, :3].eq(0.5).all()
    assert INT4_GROUP % 4 == 0


def test_pack_int4_vnni_puts_inputs_8d_to_8d_plus_7_of_a_column_in_four_bytes():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(2, 1)  # [2, 16]: -8..7, + 8 -> 0..15
    q[1] = q[1].flip(0)
    packed, scales = pack_int4_vnni(q, torch.full((2, 1), 0.5), group=16)
    assert packed.shape == (1, 2, 16, 4) and packed.dtype == torch.uint8
    # double step d, byte b: w[8d + b] + 8 low, w[8d + 4 + b] + 8 high
    assert packed[0, 0, 0].tolist() == [0x40, 0x51, 0x62, 0x73] and packed[0, 1, 0].tolist() == [0xC8, 0xD9, 0xEA, 0xFB]
    assert packed[0, 0, 1].tolist() == [0xBF, 0xAE, 0x9D, 0x8C]
    assert (packed[0, :, 2:] == 0x88).all()  # columns past N: zero weights
    assert scales.shape == (1, 1, 16) and scales[0, 0, :2].eq(0.5).all()
    with pytest.raises(ValueError, match="multiple of 16 inputs, not 8"):
        pack_int4_vnni(q, torch.ones(2, 2), group=8)
