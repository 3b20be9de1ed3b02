"""CPU kernels vs torch, side by side in one run, at the SmolLM2-135M shapes.

Reports, each as the median (and min) of interleaved repetitions, so noise from a shared machine hits
both sides alike:
  - per op: F.linear vs zeroqueue.linear for qkv/o/gate_up/down/lm_head at M = 1, 8, 32, 128;
  - a full decode-step weight stream: 30 layers with distinct weights (269 MB in bf16, so the caches do not
    flatter it) plus lm_head, at M = 1, 8, 32, as ms/step and tokens/s, against a read-bandwidth probe
    that takes turns with it (% of roofline = probe time for those bytes / our time, medians);
  - decode attention on a paged cache (blocks of 16 and 32 rows) vs a masked SDPA over the gathered blocks;
  - the fused rms_norm / silu_mul vs the torch ops they replace, per call and per decode step;
  - the machine's read bandwidth: best of several full passes over a 512 MB buffer;
  - first, the bf16 weight stream on each linear path this CPU runs (widen, dot, amx), at M = 1 to 128.

    python bench/kernel_speed.py [--dtypes bfloat16,float32] [--reps 9] [--skip-ops] [--paths-only]
                                 [--attention-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from services.inference.device import kernels  # noqa: E402
from services.logs import configure_logging  # noqa: E402

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 576, 1536, 49152, 30
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
# (name, N, K) per layer; qkv and gate_up are the fused projections the executor uses.
LAYER_SHAPES = (
    ("qkv", 960, HIDDEN),
    ("o", HIDDEN, HIDDEN),
    ("gate_up", 2 * INTERMEDIATE, HIDDEN),
    ("down", HIDDEN, INTERMEDIATE),
)
OP_SHAPES = (*LAYER_SHAPES, ("lm_head", VOCAB, HIDDEN))


def time_interleaved(fns: list[Callable[[], object]], reps: int) -> list[list[float]]:
    """Seconds per call of each fn, taking turns (a, b, c, a, b, c...) after one warm-up call each."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return times


def time_pair(a: Callable[[], object], b: Callable[[], object], reps: int) -> tuple[list[float], list[float]]:
    times_a, times_b = time_interleaved([a, b], reps)
    return times_a, times_b


def fmt_us(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e6:,.0f} ({min(times) * 1e6:,.0f})"


class BandwidthProbe:
    """One full read of a 512 MB buffer, by torch.sum or torch.mv in turn (both stream it with all
    threads, within ~5% of a hand-written AVX-512 reader here): the machine's read roofline."""

    def __init__(self) -> None:
        self.buf = torch.ones(512 * 2**20 // 4, dtype=torch.float32)
        self.rows, self.ones = self.buf.view(-1, 4096), torch.ones(4096)
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls % 2:
            self.buf.sum()
        else:
            torch.mv(self.rows, self.ones)

    def gbs(self, seconds: float) -> float:
        return self.buf.numel() * 4 / seconds / 1e9


def bench_ops(ops: kernels.CpuOps, dtype: torch.dtype, reps: int) -> None:
    print(f"\n### per op, {str(dtype).removeprefix('torch.')}: µs median (min), {torch.get_num_threads()} threads\n")
    print("| op | N×K | M | F.linear | zeroqueue.linear | speedup |")
    print("|---|---|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for name, n, k in OP_SHAPES:
        w = torch.randn(n, k, generator=gen).to(dtype)
        packed = ops.pack_linear(w)
        for m in (1, 8, 32, 128):
            x = torch.randn(m, k, generator=gen).to(dtype)
            op_reps = max(3, reps // 3) if n == VOCAB and m >= 32 else reps
            ref, ours = time_pair(lambda: F.linear(x, w), lambda: ops.linear(x, packed, None, n), op_reps)
            speedup = statistics.median(ref) / statistics.median(ours)
            print(f"| {name} | {n}×{k} | {m} | {fmt_us(ref)} | {fmt_us(ours)} | {speedup:.2f}× |")


def bench_stream(ops: kernels.CpuOps, dtype: torch.dtype, reps: int, probe: BandwidthProbe) -> None:
    """The memory bandwidth of this VM moves by tens of percent within seconds, so the probe takes turns
    with the two steps and the roofline of each row comes from the probe passes of that row."""
    gen = torch.Generator().manual_seed(1)
    weights = [[(torch.randn(n, k, generator=gen).to(dtype), n, k) for _, n, k in LAYER_SHAPES] for _ in range(LAYERS)]
    weights.append([(torch.randn(VOCAB, HIDDEN, generator=gen).to(dtype), VOCAB, HIDDEN)])
    packed = [[(ops.pack_linear(w), n, k) for w, n, k in layer] for layer in weights]
    num_bytes = sum(w.numel() * w.element_size() for layer in weights for w, _, _ in layer)
    print(
        f"\n### full weight stream, {str(dtype).removeprefix('torch.')}: {LAYERS} layers + lm_head, "
        f"{num_bytes / 1e6:.0f} MB; ms/step median (min)\n"
    )
    print("| M | F.linear | zeroqueue | speedup | zeroqueue tok/s | zeroqueue GB/s | probe GB/s | % of roofline |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in (1, 8, 32):
        xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in (HIDDEN, INTERMEDIATE)}

        def torch_step() -> None:
            for layer in weights:
                for w, _, k in layer:
                    F.linear(xs[k], w)

        def our_step() -> None:
            for layer in packed:
                for p, n, k in layer:
                    ops.linear(xs[k], p, None, n)

        ref, ours, reads = time_interleaved([torch_step, our_step, probe], reps)
        ours_s, probe_gbs = statistics.median(ours), probe.gbs(statistics.median(reads))
        print(
            f"| {m} | {statistics.median(ref) * 1e3:.1f} ({min(ref) * 1e3:.1f}) | {ours_s * 1e3:.1f} "
            f"({min(ours) * 1e3:.1f}) | {statistics.median(ref) / ours_s:.2f}× | {m / ours_s:,.0f} | "
            f"{num_bytes / ours_s / 1e9:.1f} | {probe_gbs:.1f} | "
            f"{100 * num_bytes / probe_gbs / 1e9 / ours_s:.0f}% |"
        )


def sdpa_decode(q, k_cache, v_cache, block_tables, lengths, scale):
    """The torch path: gather each sequence's blocks into its rows, mask past its length, SDPA with GQA."""
    batch, width = block_tables.shape
    _, kv_heads, block_size, head_dim = k_cache.shape
    k = k_cache[block_tables].transpose(1, 2).reshape(batch, kv_heads, width * block_size, head_dim)
    v = v_cache[block_tables].transpose(1, 2).reshape(batch, kv_heads, width * block_size, head_dim)
    mask = torch.arange(width * block_size)[None, :] < lengths[:, None]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def paged_cache(batch: int, context: int, block_size: int, dtype: torch.dtype, gen: torch.Generator):
    """k/v caches [N, KVH, BS, D] with one spare block, each sequence's blocks scattered at random among them (as a
    server's free list leaves them after a while), and the block tables [batch, context / BS]."""
    width = context // block_size
    num_blocks = batch * width + 1
    k_cache = torch.randn(num_blocks, KV_HEADS, block_size, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, KV_HEADS, block_size, HEAD_DIM, generator=gen).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width)
    return k_cache, v_cache, block_tables


def bench_attention(ops: kernels.CpuOps, dtype: torch.dtype, reps: int) -> None:
    print(
        f"\n### decode attention, {str(dtype).removeprefix('torch.')}: one layer, H={HEADS}, KVH={KV_HEADS}, "
        f"D={HEAD_DIM}, paged cache with shuffled blocks of BS rows; µs median (min)\n"
    )
    print("| B | context | BS | masked SDPA | zeroqueue.decode_attention | speedup |")
    print("|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(2)
    for batch in (1, 8, 32):
        for context in (512, 2048):
            for block_size in (16, 32):
                k_cache, v_cache, block_tables = paged_cache(batch, context, block_size, dtype, gen)
                q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
                lengths = torch.full((batch,), context)
                scale = 1 / math.sqrt(HEAD_DIM)
                ref, ours = time_pair(
                    lambda: sdpa_decode(q, k_cache, v_cache, block_tables, lengths, scale),
                    lambda: ops.decode_attention(q, k_cache, v_cache, block_tables, lengths, scale),
                    reps,
                )
                print(
                    f"| {batch} | {context} | {block_size} | {fmt_us(ref)} | {fmt_us(ours)} | "
                    f"{statistics.median(ref) / statistics.median(ours):.2f}× |"
                )


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What services/inference/device/model.py's RMSNorm does: 5 torch ops."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def bench_small_ops(ops: kernels.CpuOps, dtype: torch.dtype, reps: int) -> None:
    """The fused elementwise ops: per call and per decode step (61 norms and 30 activations)."""
    print(f"\n### fused small ops, {str(dtype).removeprefix('torch.')}: µs per call, median (min)\n")
    print("| op | M | torch | zeroqueue | saved per step (ms) |")
    print("|---|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(HIDDEN, generator=gen).to(dtype)
    for m in (1, 32):
        x = torch.randn(m, HIDDEN, generator=gen).to(dtype)
        gate_up = torch.randn(m, 2 * INTERMEDIATE, generator=gen).to(dtype)
        gate, up = gate_up.split(INTERMEDIATE, -1)
        cases = (
            ("rms_norm", 2 * LAYERS + 1, lambda: hf_rms_norm(x, weight, 1e-5), lambda: ops.rms_norm(x, weight, 1e-5)),
            ("silu_mul", LAYERS, lambda: F.silu(gate) * up, lambda: ops.silu_mul(gate_up)),
        )
        for name, per_step, ref_fn, our_fn in cases:
            ref, ours = time_pair(ref_fn, our_fn, reps * 20)
            saved_ms = per_step * (statistics.median(ref) - statistics.median(ours)) * 1e3
            print(f"| {name} | {m} | {fmt_us(ref)} | {fmt_us(ours)} | {saved_ms:.2f} |")


def bench_bf16_paths(ops: kernels.CpuOps, reps: int, probe: BandwidthProbe) -> None:
    """The bf16 weight stream on every linear path this CPU runs, taking turns with each other and the probe:
    which path a process should take (kernels/__init__.py chooses once a process)."""
    names = [name for name in ops.bf16_paths if name != "amx" or kernels.amx_available()]
    variants = [dataclasses.replace(ops, bf16_path=kernels.BF16_PATHS.index(name)) for name in names]
    gen = torch.Generator().manual_seed(2)
    packed = [
        (ops.pack_linear(torch.randn(n, k, generator=gen).to(torch.bfloat16)), n, k)
        for _ in range(LAYERS)
        for _, n, k in LAYER_SHAPES
    ]
    packed.append((ops.pack_linear(torch.randn(VOCAB, HIDDEN, generator=gen).to(torch.bfloat16)), VOCAB, HIDDEN))
    num_bytes = sum(p.numel() * 2 for p, _, _ in packed)
    print(
        f"\n### bf16 linear paths: the full weight stream ({num_bytes / 1e6:.0f} MB), ms/step median (min); "
        f"this process chose {ops.bf16_path_name}\n"
    )
    print("| M | " + " | ".join(names) + " | probe GB/s |")
    print("|---:|" + "---:|" * (len(names) + 1))
    for m in (1, 8, 32, 128):
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in (HIDDEN, INTERMEDIATE)}
        steps = [functools.partial(_stream, variant, packed, xs) for variant in variants]
        *times, reads = time_interleaved([*steps, probe], max(3, reps // 2) if m == 128 else reps)
        print(
            f"| {m} | "
            + " | ".join(f"{statistics.median(t) * 1e3:.1f} ({min(t) * 1e3:.1f})" for t in times)
            + f" | {probe.gbs(statistics.median(reads)):.1f} |"
        )


def _stream(ops: kernels.CpuOps, packed: list, xs: dict) -> None:
    for p, n, k in packed:
        ops.linear(xs[k], p, None, n)


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    model = fields.get("Model name", platform.processor()).strip()
    return f"{model}, {fields.get('CPU(s)', '?').strip()} CPUs, torch {torch.__version__}"


def loaded_kernels() -> kernels.CpuOps:
    """The kernels this CPU runs (or exit saying why not), after printing the run's header: when, where, which."""
    ops = kernels.load_cpu_ops()
    if ops is None:
        sys.exit(f"CPU kernels unavailable: {kernels.reason_unavailable()}")
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"{now}; {machine()}; {ops.isa} kernels ({ops.bf16_path_name} bf16 path); {torch.get_num_threads()} "
        f"threads; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    return ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--skip-ops", action="store_true", help="only the weight stream and attention")
    parser.add_argument("--paths-only", action="store_true", help="only the bf16 linear paths side by side")
    parser.add_argument("--attention-only", action="store_true", help="only decode attention")
    args = parser.parse_args()
    ops = loaded_kernels()
    if args.attention_only:
        for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
            bench_attention(ops, dtype, args.reps)
        return
    probe = BandwidthProbe()
    best = max(probe.gbs(t) for t in time_interleaved([probe], 8)[0])
    print(f"read bandwidth: best {best:.1f} GB/s over 8 full passes of a 512 MB buffer (torch.sum, torch.mv)")
    bench_bf16_paths(ops, args.reps, probe)
    if args.paths_only:
        return
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        if not args.skip_ops:
            bench_ops(ops, dtype, args.reps)
        bench_stream(ops, dtype, args.reps, probe)
        bench_attention(ops, dtype, args.reps)
        bench_small_ops(ops, dtype, args.reps)


if __name__ == "__main__":
    configure_logging()  # every line on stderr: stdout is the bench's report
    main()
