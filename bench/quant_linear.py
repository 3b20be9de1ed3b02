"""Quantized weights on this CPU, first measurement (issue 34): is torch's own weight-only int8 / int4 matmul a
candidate against zeroqueue's bf16 kernels, before any kernel of ours is written for it?

Side by side in one run, taking turns with a read-bandwidth probe (bench/kernel_speed.py's), over the decoder
layers of the SmolLM2-135M shape with distinct weights per layer (30 layers, 213 MB in bf16, so no cache flatters
anyone), at M = 1, 8, 32 rows, ms per pass, median (min):
  - zeroqueue bf16: the packed linear kernel the executor runs today (`zeroqueue.linear`);
  - zeroqueue int8: `zeroqueue.linear_int8` (kernels/linear_int8.cpp), the same int8 weights in the bf16 layout's
    panels, converted to bf16 in registers for one row block and once per call into a cached buffer for more, then
    multiplied as our bf16 is (VDPBF16PS or widened FMAs), the scale applied after the K loop;
  - zeroqueue int8 VNNI: the same op on `quant.pack_int8_vnni`'s quads, x quantized per row to int8 and the
    products summed by VPDPBUSD (the AVX-512 build) or VPMADDUBSW (the AVX2 build): the `vnni` int path;
  - zeroqueue int4 g32 / g64: `zeroqueue.linear_int4` (kernels/linear_int4.cpp), symmetric int4 per group of 32 /
    64 inputs (quant.quantize_int4), two weights a byte in 16-column panels, turned into bf16 pairs in registers
    (or once per call into a buffer for more than 4 rows), each group's sum scaled into the row's accumulator;
  - torch int8: `aten._weight_int8pack_mm`, symmetric int8 per output channel, bf16 activations and scales;
  - torch int4 g32 / g64: `aten._weight_int4pack_mm_for_cpu`, asymmetric int4 per group of 32 / 64 inputs
    (the hidden size, 576, has no group of 128);
  - int8, dequantized then F.linear: what a plain-torch fallback that keeps int8 weights in memory costs.
Each row also gives the weight bytes read per second and that as a share of the probe's bandwidth, and the error
of each path against an fp32 product with the same quantized weights (the kernel's own error, not quantization's:
quantization's cost in quality is measured on the model, by NLL, not on random weights).

    python bench/quant_linear.py [--reps 9] [--rows 1,8,32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.kernel_speed import LAYER_SHAPES, LAYERS, BandwidthProbe, loaded_kernels, time_interleaved  # noqa: E402
from services.inference.device import kernels  # noqa: E402
from services.inference.device.quant import dequantize_int4, pack_int4, pack_int4_vnni, pack_int8_vnni, quantize_int4  # noqa: E402
from services.logs import configure_logging  # noqa: E402


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] fp32 -> (int8 [N, K], bf16 scales [N]): w ≈ q * scale, symmetric per output channel."""
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale.to(torch.bfloat16)


def int4_grouped(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] fp32 -> (packed int4 for the CPU op, bf16 scales-and-zeros [K/group, N, 2], the dequantized w):
    asymmetric per group of `group` inputs, w ≈ (q - 8) * scale + zero with q in 0..15."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.clamp(torch.round((g - lo) / scale), 0, 15)
    zero = lo + 8 * scale
    dequant = ((q - 8) * scale + zero).reshape(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).reshape(n, k), 1)
    scales_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, scales_zeros, dequant


class Layers:
    """The decoder layers' linear weights in every form the paths read."""

    def __init__(self, ops: kernels.CpuOps, num_layers: int) -> None:
        gen = torch.Generator().manual_seed(1)
        self.ops = ops
        self.bf16, self.int8, self.zq_int8, self.zq_vnni, self.int4 = [], [], [], [], {32: [], 64: []}
        self.zq_int4: dict[int, list] = {32: [], 64: []}
        self.zq_int4_vnni: list = []
        self.bytes = {"bf16": 0, "int8": 0, 32: 0, 64: 0}
        for _ in range(num_layers):
            for _, n, k in LAYER_SHAPES:
                w = torch.randn(n, k, generator=gen) * 0.02
                self.bf16.append((ops.pack_linear(w.to(torch.bfloat16)), n, k))
                self.bytes["bf16"] += 2 * n * k
                q, s = int8_per_channel(w)
                self.int8.append((q, s, k))
                self.zq_int8.append((ops.pack_linear(q), s.float(), n, k))
                self.zq_vnni.append((pack_int8_vnni(q), s.float(), n, k))
                self.bytes["int8"] += n * k + 2 * n
                for group, out in self.int4.items():
                    packed, sz, _ = int4_grouped(w, group)
                    out.append((packed, sz, k))
                    self.bytes[group] += n * k // 2 + 4 * n * (k // group)
                    self.zq_int4[group].append((*pack_int4(*quantize_int4(w, group), group), n))
                self.zq_int4_vnni.append((*pack_int4_vnni(*quantize_int4(w, 64), 64), n, k))

    def steps(self, xs: dict[int, torch.Tensor]) -> dict[str, object]:
        ops = self.ops

        def bf16() -> None:
            for p, n, k in self.bf16:
                ops.linear(xs[k], p, None, n)

        def zq_int8() -> None:
            for p, s, n, k in self.zq_int8:
                ops.linear_int8(xs[k], p, s, None, n)

        def zq_vnni() -> None:
            for p, s, n, k in self.zq_vnni:
                ops.linear_int8(xs[k], p, s, None, n)

        def zq_int4(group: int):
            def run() -> None:
                for p, s, n in self.zq_int4[group]:
                    ops.linear_int4(xs[p.shape[1] * 4], p, s, None, n)

            return run

        def zq_int4_vnni() -> None:
            for p, s, n, k in self.zq_int4_vnni:
                ops.linear_int4(xs[k], p, s, None, n)

        def int8() -> None:
            for q, s, k in self.int8:
                torch.ops.aten._weight_int8pack_mm(xs[k], q, s)

        def int8_fallback() -> None:
            for q, s, k in self.int8:
                F.linear(xs[k], q.to(torch.bfloat16) * s[:, None])

        def int4(group: int):
            def run() -> None:
                for packed, sz, k in self.int4[group]:
                    torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k], packed, group, sz)

            return run

        return {
            "zeroqueue bf16": (bf16, self.bytes["bf16"]),
            "zeroqueue int8": (zq_int8, self.bytes["int8"]),
            "zeroqueue int8 VNNI": (zq_vnni, self.bytes["int8"]),
            "zeroqueue int4 g32": (zq_int4(32), self.bytes[32]),
            "zeroqueue int4 g64": (zq_int4(64), self.bytes[64]),
            "zeroqueue int4 g64 VNNI": (zq_int4_vnni, self.bytes[64]),
            "torch int8": (int8, self.bytes["int8"]),
            "torch int4 g32": (int4(32), self.bytes[32]),
            "torch int4 g64": (int4(64), self.bytes[64]),
            "int8 dequant + F.linear": (int8_fallback, self.bytes["int8"]),
        }


def kernel_errors(ops: kernels.CpuOps) -> dict[str, float]:
    """Max |path - fp32 product with the same quantized weights| / max |fp32 product|, on the gate_up shape."""
    gen = torch.Generator().manual_seed(2)
    _, n, k = LAYER_SHAPES[2]
    w, x = torch.randn(n, k, generator=gen) * 0.02, torch.randn(8, k, generator=gen).to(torch.bfloat16)
    xf = x.float()
    q, s = int8_per_channel(w)
    packed, sz, dequant4 = int4_grouped(w, 32)
    wb, q4 = w.to(torch.bfloat16), quantize_int4(w, 64)
    pairs = {
        "zeroqueue bf16": (ops.linear(x, ops.pack_linear(wb), None, n), xf @ wb.float().T),
        "zeroqueue int8": (
            ops.linear_int8(x, ops.pack_linear(q), s.float(), None, n),
            xf @ (q.float() * s.float()[:, None]).T,
        ),
        "zeroqueue int8 VNNI": (
            ops.linear_int8(x, pack_int8_vnni(q), s.float(), None, n),
            xf @ (q.float() * s.float()[:, None]).T,
        ),
        "zeroqueue int4 g64": (
            ops.linear_int4(x, *pack_int4(*q4, 64), None, n),
            xf @ dequantize_int4(*q4, torch.float32, 64).T,
        ),
        "torch int8": (torch.ops.aten._weight_int8pack_mm(x, q, s), xf @ (q.float() * s.float()[:, None]).T),
        "torch int4 g32": (torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz), xf @ dequant4.T),
    }
    return {name: ((y.float() - ref).abs().max() / ref.abs().max()).item() for name, (y, ref) in pairs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--layers", type=int, default=LAYERS)
    args = parser.parse_args()
    ops = loaded_kernels()
    layers, probe = Layers(ops, args.layers), BandwidthProbe()
    print("\nkernel error against fp32 with the same weights (max abs / max |ref|): " + ", ".join(
        f"{name} {err:.1e}" for name, err in kernel_errors(ops).items()
    ))  # fmt: skip
    print(f"\n### {args.layers} decoder layers of the SmolLM2-135M shape: ms per pass, median (min)\n")
    print("| M | path | weight MB | ms | vs zeroqueue bf16 | GB/s of weights | % of probe |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(3)
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for _, _, k in LAYER_SHAPES}
        paths = layers.steps(xs)
        *times, reads = time_interleaved([fn for fn, _ in paths.values()] + [probe], args.reps)
        probe_gbs = probe.gbs(statistics.median(reads))
        base_s = statistics.median(times[0])
        for (name, (_, num_bytes)), t in zip(paths.items(), times):
            s = statistics.median(t)
            print(
                f"| {m} | {name} | {num_bytes / 1e6:.0f} | {s * 1e3:.2f} ({min(t) * 1e3:.2f}) | {base_s / s:.2f}× "
                f"| {num_bytes / s / 1e9:.1f} | {100 * num_bytes / s / 1e9 / probe_gbs:.0f}% |"
            )
    print(f"\nprobe: {probe_gbs:.1f} GB/s in the last row's turns")


if __name__ == "__main__":
    configure_logging()  # every line on stderr: stdout is the bench's report
    main()
