"""The `vnni` int path's quads on both builds (kernels/vnni.h): the AVX-512 build sums them with VPDPBUSD, the AVX2
build with VPMADDUBSW and VPMADDWD. Both sum the same integers exactly and scale them with the same instructions, so
a replica's tokens must not depend on which build it loaded: their outputs are compared bit for bit."""

from __future__ import annotations

import zlib

import torch

from services.inference.device.quant import pack_int4_vnni, pack_int8_vnni, quantize_int4, quantize_int8
from tests.inference.builds import check_in_build
from tests.inference.test_kernels import ops  # noqa: F401 - the fixture: the loaded build, or why not

SHAPES = ((960, 576), (17, 48), (130, 256))  # (N, K): whole panels, a ragged one and a group that is not a quad's
ROWS = (1, 3, 9, 32)


def quads_digest(isa: str) -> int:
    """A checksum of int8 and int4 quads' outputs (fp32 and bf16 x, with a bias, weights of every magnitude including
    int8's -128) in the build this process loaded; `isa` names it, as check_in_build passes."""
    gen, digest = torch.Generator().manual_seed(7), 0
    for n, k in SHAPES:
        q8, scale8 = quantize_int8(torch.randn(n, k, generator=gen))
        q8[0, :5] = -128
        q4, scale4 = quantize_int4(torch.randn(n, k, generator=gen), 16)
        int8 = (pack_int8_vnni(q8), scale8)
        int4 = pack_int4_vnni(q4, scale4, 16)
        bias = torch.randn(n, generator=gen)
        for m in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
                for y in (
                    torch.ops.zeroqueue.linear_int8(x, *int8, bias, n, 0),
                    torch.ops.zeroqueue.linear_int4(x, *int4, bias, n, 0),
                ):
                    digest = zlib.crc32(y.contiguous().view(torch.uint8).numpy().tobytes(), digest)
    return digest


def test_the_builds_quads_give_the_same_bits(ops):  # noqa: F811
    other = "avx2" if ops.isa != "avx2" else "avx512"
    assert check_in_build(other, ops.isa, "tests.inference.test_kernel_quads", "quads_digest") == quads_digest(ops.isa)
