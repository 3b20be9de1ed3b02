"""The parts of bench/gpu_check.py that run the model: each fills the dict it is given as it goes, so a part
that fails later keeps what it measured before."""

from __future__ import annotations

import random
import statistics
import time

import torch

from services.inference.device.attention import AttentionMetadata
from services.inference.device.cuda_graphs import GraphRunner, attention_kernels
from services.inference.device.executor import Executor, ExecutorConfig
from services.inference.device.loader import Checkpoint
from services.inference.device.quant import fp8_layers
from services.inference.device.sampler import sample
from services.inference.engine.engine import Engine, RequestOutput
from services.inference.sched.request import Request, SamplingParams


class Sink:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str | None] = {}

    def put(self, output: RequestOutput) -> None:
        self.tokens.setdefault(output.call_id, []).extend(output.token_ids)
        if output.finish_reason is not None:
            self.finish[output.call_id] = output.finish_reason


def make_engine(
    ckpt: Checkpoint, device: str, max_batch: int, graphs: bool, max_seq_len: int = 512, quantize: str = "none"
) -> Engine:
    """The engine on `device`, on plain torch (the CPU kernels are never the GPU's code); quantize "fp8" on a GPU. The
    CPU dry run's fp8 swaps the layers itself (torch._scaled_mm runs there too; the executor refuses fp8 on a CPU)."""
    cpu_fp8 = quantize == "fp8" and not device.startswith("cuda")
    executor = Executor(
        ckpt,
        ExecutorConfig(
            device=device,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            kv_memory_bytes=16 << 30,
            use_cuda_graphs=graphs,
            use_kernels=False,
            quantize="none" if cpu_fp8 else quantize,
        ),
    )
    if cpu_fp8:
        fp8_layers(executor.model.layers)
    if graphs and executor.graphs is None:  # CPU dry run: the padded static path, not captured
        executor.graphs = GraphRunner(
            executor.model, executor.backend, executor.num_slots, executor.max_seq_len, executor.device, capture=False
        )
    return Engine(executor, ckpt.tokenizer, ())


def prompts(batch: int, vocab: int, seed: int, longest: int = 64) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(1, vocab) for _ in range(rng.randint(4, longest))) for _ in range(batch)]


def add_calls(
    engine: Engine,
    sink: Sink,
    name: str,
    batch: int,
    max_tokens: int,
    seed: int,
    longest: int = 64,
    temperature: float = 0.0,
) -> None:
    for i, prompt in enumerate(prompts(batch, engine.executor.model.args.vocab_size, seed, longest)):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, ignore_eos=True)
        engine.add_request(Request(f"{name}-{i}", prompt, params, engine.clock()), sink)


def run_all(engine: Engine, reports: list | None = None) -> None:
    while engine.has_work:
        report = engine.step()
        if reports is not None and report is not None:
            reports.append(report)


def finish_prompts(engine: Engine) -> None:
    """Steps until every queued request has its prompt in the cache, so the next step is decode-only."""
    engine.step()
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def greedy_graph_vs_eager(out: dict, ckpt, device: str, batches: list[int], tokens: int) -> None:
    """Greedy tokens of the graph engine and the eager one, batch by batch, mixed prompt lengths."""
    graph_engine = make_engine(ckpt, device, max(batches), graphs=True)
    eager_engine = make_engine(ckpt, device, max(batches), graphs=False)
    for batch in batches:
        runs = []
        for engine in (graph_engine, eager_engine):
            sink = Sink()
            add_calls(engine, sink, f"g{batch}", batch, tokens, seed=batch)
            run_all(engine)
            runs.append(sink.tokens)
        a, b = runs
        prefix = [next((j for j, (x, y) in enumerate(zip(a[k], b[k])) if x != y), tokens) for k in a]
        out[str(batch)] = {
            "identical_sequences": f"{sum(a[k] == b[k] for k in a)}/{batch}",
            "min_identical_prefix": min(prefix),
        }


def replay_vs_static(out: dict, ckpt, device: str, batches: list[int]) -> None:
    """A graph and the same padded forward run eagerly, over identical buffers and cache: bitwise equal. The
    prefill is chunked, and some calls finish during it: the comparison is over the calls still decoding."""
    engine = make_engine(ckpt, device, max(batches), graphs=True)
    runner = engine.executor.graphs
    for batch in batches:
        add_calls(engine, Sink(), f"r{batch}", batch, 4, seed=batch)
        finish_prompts(engine)
        step = engine.scheduler.schedule(engine.clock())
        n = len(step.decodes)
        with torch.inference_mode(), attention_kernels(engine.executor.device):  # the kernels the graph has
            bucket = runner.prepare(step.decodes)
            static = runner.forward_static(bucket)[:n].float().clone()
            replayed = runner.replay(step.decodes)[0].float().clone()
        out[str(batch)] = {
            "decoding": n,
            "bucket": list(bucket),
            "bitwise_equal": bool(torch.equal(static, replayed)),
            "max_abs_diff": float((static - replayed).abs().max()) if n else 0.0,
            "captured": bucket in runner.graphs,
        }
        run_all(engine)


def sampling_vs_cpu(out: dict, device: str, vocab: int, rows: int = 32) -> None:
    """sample() on the device and on the host, from the same logits, at the API's default temperature and
    with each filter: the same tokens."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g) * 4
    kinds = [
        SamplingParams(),
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=50),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.95),
    ]
    params = [SamplingParams(**{**kinds[i % len(kinds)].__dict__, "seed": i}) for i in range(rows)]
    draws = [random.Random(i).randrange(1000) for i in range(rows)]
    on_device = logits.to(device)
    sample(on_device, params, draws)  # warm-up
    t0 = time.perf_counter()
    device_tokens = sample(on_device, params, draws)
    device_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    host_tokens = sample(logits, params, draws)
    host_ms = (time.perf_counter() - t0) * 1e3
    out |= {
        "rows": rows,
        "identical_tokens": f"{sum(a == b for a, b in zip(device_tokens, host_tokens))}/{rows}",
        "sample_ms_device_logits": round(device_ms, 2),
        "sample_ms_host_logits": round(host_ms, 2),
    }


@torch.inference_mode()
def first_logits(executor: Executor, prompt: tuple[int, ...]) -> torch.Tensor:
    """fp32 logits [vocab] at the prompt's last position, from one prefill into the first blocks (eager, as serving)."""
    n, dev, bs = len(prompt), executor.device, executor.kv_cache.block_size
    meta = AttentionMetadata.prefill(torch.arange(-(-n // bs), device=dev), bs, 0, n)
    positions = meta.positions
    with attention_kernels(dev):
        logits = executor.model(
            torch.tensor(prompt, device=dev), positions, torch.tensor([n - 1], device=dev), executor.backend, meta
        )
    return logits[0].float().cpu()


def logits_vs_cpu(out: dict, ckpt, device: str, num_prompts: int = 4) -> None:
    """The first step's logits on the device against plain torch on the CPU, same weights, same dtype."""
    subject, reference = (make_engine(ckpt, d, 1, graphs=False).executor for d in (device, "cpu"))
    for i, prompt in enumerate(prompts(num_prompts, ckpt.args.vocab_size, seed=100)):
        a, b = first_logits(subject, prompt), first_logits(reference, prompt)
        out[f"prompt{i}"] = {
            "tokens": len(prompt),
            "max_abs_diff": round(float((a - b).abs().max()), 4),
            "logit_std": round(float(b.std()), 3),
            "same_argmax": int(a.argmax()) == int(b.argmax()),
            "top5_overlap": len(set(a.topk(5).indices.tolist()) & set(b.topk(5).indices.tolist())),
        }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, num_bytes: int, repeats: int = 5) -> float:
    """Bytes read + written per second by a device-to-device copy (best of `repeats`)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * num_bytes / best


def kv_bytes_per_token(ckpt) -> int:
    a = ckpt.args
    return 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * ckpt.dtype.itemsize


def decode_speed(
    out: dict, ckpt, device: str, batches: list[int], steps: int, quantize: str = "none", modes=(True, False)
) -> None:
    """Decode tokens/s with graphs and eagerly (`modes`: graphs or not); each step against a floor of the bytes it
    must read: the weights once, and every row's KV cache up to its length (bf16 weights' bytes, also for fp8)."""
    weight_bytes = sum(t.numel() * t.element_size() for name, t in ckpt.state_dict.items() if name != "lm_head.weight")
    bandwidth = copy_bandwidth(device, (1 << 30) if device.startswith("cuda") else (64 << 20))
    out |= {
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token(ckpt),
        "copy_bandwidth_gbps": round(bandwidth / 1e9, 1),
    }
    for graphs in modes:
        engine = make_engine(ckpt, device, max(batches), graphs, max_seq_len=256, quantize=quantize)
        for batch in batches:
            add_calls(engine, Sink(), f"s{batch}", batch, steps + 8, seed=7, longest=16)
            finish_prompts(engine)
            context = sum(r.num_tokens for r in engine.scheduler.running)
            device_us = []
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                device_us.append(engine.step().result.device_time_us)
            elapsed = time.perf_counter() - t0
            floor_bytes = weight_bytes + (context + batch * steps // 2) * kv_bytes_per_token(ckpt)
            out[f"{'graph' if graphs else 'eager'}_b{batch}"] = {
                "tokens_per_s": round(batch * steps / elapsed, 1),
                "step_ms": round(elapsed / steps * 1e3, 3),
                "device_step_ms_median": round(statistics.median(device_us) / 1e3, 3),
                "floor_ms": round(floor_bytes / bandwidth * 1e3, 4),
            }
            run_all(engine)
    for batch in batches if len(modes) == 2 else ():
        graph, eager = out[f"graph_b{batch}"], out[f"eager_b{batch}"]
        graph["speedup_vs_eager"] = round(graph["tokens_per_s"] / eager["tokens_per_s"], 2)
        graph["floor_over_step"] = round(graph["floor_ms"] / graph["step_ms"], 3)


def kernels_used(out: dict, ckpt, device: str, batch: int = 8) -> None:
    """The device's kernels (or the CPU's ops) in one graph replay and one eager decode step, by time."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device.startswith("cuda") else ProfilerActivity.CPU
    for graphs in (True, False):
        engine = make_engine(ckpt, device, batch, graphs, max_seq_len=256)
        add_calls(engine, Sink(), "k", batch, 8, seed=3, longest=16)
        finish_prompts(engine)
        engine.step()  # warm: the profile sees a steady step
        with profile(activities=[activity]) as prof:
            report = engine.step()
            _sync(device)
        events = [
            e
            for e in prof.key_averages()
            if (e.device_time_total if activity == ProfilerActivity.CUDA else e.self_cpu_time_total) > 0
        ]
        key = (
            (lambda e: e.device_time_total) if activity == ProfilerActivity.CUDA else (lambda e: e.self_cpu_time_total)
        )
        events.sort(key=key, reverse=True)
        names = [e.key for e in events]
        out["graph_replay" if graphs else "eager_step"] = {
            "used_graph": report.result.used_graph,
            "attention": [
                n[:160]
                for n in names
                if any(w in n.lower() for w in ("attention", "fmha", "flash", "cudnn", "sdpa", "softmax"))
            ][:8],
            "top": [{"name": e.key[:160], "us": round(key(e), 1), "calls": e.count} for e in events[:12]],
        }
        run_all(engine)
