"""The GPU path, checked on a real device: CUDA-graph replay, speed, SM·µs, and (if present) the pulse.

    python bench/gpu_check.py              # on a machine with an NVIDIA GPU (made for one H200, < 6 min)
    python bench/gpu_check.py --dry-run    # on CPU with a tiny model: every step but the graph capture

Writes gpu_check.json and gpu_check.log under $OUT when set, else bench/out/gpu_check/. Needs torch,
safetensors, tokenizers, grpcio, protobuf, nvidia-ml-py and structlog; sqlalchemy (billing records) only
for the metering part. See BENCHMARKS.md ("GPU") for bringing missing packages as wheels.

1. device facts: name, SMs from torch and NVML, MIG mode, memory, driver;
2. correctness: a SmolLM2-135M-shaped random model in bf16 with a graph captured per batch bucket;
   replayed logits vs the same padded forward run eagerly (bitwise), and 64 greedy tokens from the graph
   engine vs the eager engine for batches of 1, 8 and 32 with mixed prompt lengths;
3. speed: decode tokens/s with graphs vs eager at batch 1, 8, 32, 128, and a step against its bandwidth
   floor (weight bytes / measured device copy bandwidth);
4. metering: step time from CUDA events vs a host clock around the synchronised step, and the per-request
   SM·µs split conserving every step's total.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

from services.inference.engine import Engine, RequestOutput  # noqa: E402
from services.inference.executor import Executor, ExecutorConfig, GraphRunner, describe_device  # noqa: E402
from services.inference.loader import load_checkpoint  # noqa: E402
from services.inference.nvml import gpu_facts  # noqa: E402
from services.inference.request import Request, SamplingParams  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-5)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512, rms_norm_eps=1e-5)


class Report:
    def __init__(self, out: Path) -> None:
        self.out, self.data = out, {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        out.mkdir(parents=True, exist_ok=True)
        self.log_file = open(out / "gpu_check.log", "a", encoding="utf-8")

    def log(self, message: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {message}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def section(self, name: str, run) -> None:
        """Runs one part; a failure is recorded with its trace and the next part still runs."""
        t0 = time.monotonic()
        self.log(f"--- {name}")
        try:
            self.data[name] = run()
        except Exception as exc:  # noqa: BLE001 - a report that says what failed beats no report
            self.data[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        self.data[name + "_seconds"] = round(time.monotonic() - t0, 1)
        self.log(json.dumps(self.data[name], indent=1)[:4000])
        self.save()

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=2))


def write_checkpoint(root: Path, shape: dict, seed: int = 0, std: float = 0.08) -> Path:
    """A random Llama checkpoint in the Hugging Face layout, bf16; a larger init than usual keeps the
    logits peaked, so greedy comparisons are not decided by near-ties."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    g = torch.Generator().manual_seed(seed)
    h, inter, kv = shape["hidden_size"], shape["intermediate_size"], shape["num_key_value_heads"]
    head_dim = h // shape["num_attention_heads"]
    rand = lambda *dims: (torch.randn(*dims, generator=g) * std).to(torch.bfloat16)  # noqa: E731
    tensors = {"model.embed_tokens.weight": rand(shape["vocab_size"], h), "model.norm.weight": torch.ones(h).bfloat16()}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv * head_dim, h),
                    p + "self_attn.v_proj.weight": rand(kv * head_dim, h), p + "self_attn.o_proj.weight": rand(h, h),
                    p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                    p + "mlp.down_proj.weight": rand(h, inter), p + "input_layernorm.weight": torch.ones(h).bfloat16(),
                    p + "post_attention_layernorm.weight": torch.ones(h).bfloat16()}
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
              "torch_dtype": "bfloat16", "eos_token_id": 0, "rope_theta": 10000.0, **shape}
    (root / "config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
    tokenizer.train_from_iterator(["def f(x):\n    return x * 2\n"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(root / "tokenizer.json"))
    return root


class Sink:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def put(self, output: RequestOutput) -> None:
        self.tokens.setdefault(output.request_id, []).extend(output.token_ids)


def make_engine(ckpt, device: str, max_batch: int, graphs: bool, max_seq_len: int = 512) -> Engine:
    executor = Executor(ckpt, ExecutorConfig(device=device, max_batch=max_batch, max_seq_len=max_seq_len,
                                             kv_memory_bytes=16 << 30, use_cuda_graphs=graphs))
    if graphs and executor.graphs is None:          # CPU dry run: the padded static path, not captured
        executor.graphs = GraphRunner(executor.model, executor.backend, executor.num_slots, executor.max_seq_len,
                                      executor.device, capture=False)
    return Engine(executor, ckpt.tokenizer, ())


def prompts(batch: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(1, vocab) for _ in range(rng.randint(4, 64))) for _ in range(batch)]


def generate(engine: Engine, batch: int, max_tokens: int, seed: int = 0,
             reports: list | None = None) -> dict[str, list[int]]:
    sink = Sink()
    for i, prompt in enumerate(prompts(batch, engine.executor.model.args.vocab_size, seed)):
        engine.add_request(Request(f"b{batch}-{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                            ignore_eos=True), engine.clock()), sink)
    while engine.has_work:
        report = engine.step()
        if reports is not None and report is not None:
            reports.append(report)
    return sink.tokens


def finish_prompts(engine: Engine) -> None:
    """Steps until every queued request has its prompt in the cache, so the next step is decode-only."""
    engine.step()
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def device_facts(device: str) -> dict:
    info = describe_device(torch.device(device))
    facts = {"torch": torch.__version__, "device": info.__dict__}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        nvml = gpu_facts(str(props.uuid))
        facts |= {"sm_count_torch": props.multi_processor_count, "memory_bytes": props.total_memory,
                  "capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda,
                  "nvml": nvml.__dict__ if nvml else None}
    return facts


def replay_vs_static(engine: Engine, batches: list[int]) -> dict:
    """The graph and the same padded forward run eagerly, over identical buffers and cache: bitwise equal."""
    runner = engine.executor.graphs
    out = {}
    for batch in batches:
        for i, prompt in enumerate(prompts(batch, engine.executor.model.args.vocab_size, batch)):
            engine.add_request(Request(f"r{batch}-{i}", prompt, SamplingParams(max_tokens=4, temperature=0.0,
                                                                                ignore_eos=True), engine.clock()),
                               Sink())
        finish_prompts(engine)
        step = engine.scheduler.schedule(engine.clock())
        with torch.inference_mode():
            bucket = runner.prepare(step.decodes)
            static = runner.forward_static(bucket)[:batch].float().clone()
            replayed = runner.replay(step.decodes)[0].float().clone()
        out[str(batch)] = {"bucket": bucket, "bitwise_equal": bool(torch.equal(static, replayed)),
                           "max_abs_diff": float((static - replayed).abs().max()), "captured": bucket in runner.graphs}
        while engine.has_work:
            engine.step()
    return out


def greedy_graph_vs_eager(ckpt, device: str, batches: list[int], max_batch: int, tokens: int) -> dict:
    out = {}
    graph_engine = make_engine(ckpt, device, max_batch, graphs=True)
    eager_engine = make_engine(ckpt, device, max_batch, graphs=False)
    for batch in batches:
        a, b = generate(graph_engine, batch, tokens, seed=batch), generate(eager_engine, batch, tokens, seed=batch)
        same = sum(a[k] == b[k] for k in a)
        prefix = [next((j for j, (x, y) in enumerate(zip(a[k], b[k])) if x != y), tokens) for k in a]
        out[str(batch)] = {"identical_sequences": f"{same}/{batch}", "min_identical_prefix": min(prefix)}
    out["replay_vs_static"] = replay_vs_static(graph_engine, batches)
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, num_bytes: int = 1 << 30, repeats: int = 5) -> float:
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


def decode_speed(ckpt, device: str, batches: list[int], steps: int) -> dict:
    weight_bytes = sum(t.numel() * t.element_size() for name, t in ckpt.state_dict.items() if name != "lm_head.weight")
    bandwidth = copy_bandwidth(device, (1 << 30) if device.startswith("cuda") else (64 << 20))
    out = {"weight_bytes": weight_bytes, "copy_bandwidth_gbps": round(bandwidth / 1e9, 1),
           "bandwidth_floor_ms": round(weight_bytes / bandwidth * 1e3, 4)}
    for graphs in (True, False):
        engine = make_engine(ckpt, device, max(batches), graphs, max_seq_len=256)
        for batch in batches:
            for i, prompt in enumerate(prompts(batch, ckpt.args.vocab_size, 7)):
                engine.add_request(Request(f"s{batch}-{i}", prompt[:16], SamplingParams(
                    max_tokens=steps + 8, temperature=0.0, ignore_eos=True), engine.clock()), Sink())
            finish_prompts(engine)
            device_us = []
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                device_us.append(engine.step().result.device_time_us)
            elapsed = time.perf_counter() - t0
            out[f"{'graph' if graphs else 'eager'}_b{batch}"] = {
                "tokens_per_s": round(batch * steps / elapsed, 1), "step_ms": round(elapsed / steps * 1e3, 3),
                "device_step_ms_median": round(statistics.median(device_us) / 1e3, 3)}
            while engine.has_work:
                engine.step()
    for batch in batches:
        graph, eager = out[f"graph_b{batch}"], out[f"eager_b{batch}"]
        graph["speedup_vs_eager"] = round(graph["tokens_per_s"] / eager["tokens_per_s"], 2)
        graph["floor_over_step"] = round(out["bandwidth_floor_ms"] / graph["step_ms"], 3)
    return out


def metering_check(ckpt, device: str, batch: int, tokens: int) -> dict:
    from services.inference.meter import Device, Meter, RecordContext

    engine = make_engine(ckpt, device, batch, graphs=True)
    info = engine.executor.info
    records: list = []
    now_ns = engine.clock()
    meter = Meter(Device(info.kind, info.device_id, info.unit, info.num_compute_units), "gpucheck",
                  lambda ns: (ns - now_ns) // 1000 + 1_800_000_000_000_000, lambda usage, idle: records.extend(build() for build in usage),
                  started_ns=now_ns)
    reports: list = []
    engine.observers.append(meter)
    epoch = 1_800_000_000_000_000
    for i in range(batch):
        meter.register(f"b{batch}-{i}", RecordContext("gpucheck", {}, "random", epoch, epoch, epoch + 10**12))
    generate(engine, batch, tokens, reports=reports)
    steps = [r for r in reports if r.result is not None]
    ratios = [r.result.device_time_us / max(r.interval_ns / 1000, 1) for r in steps]
    return {"steps": len(steps), "device_over_host_time_median": round(statistics.median(ratios), 3),
            "device_over_host_time_min": round(min(ratios), 3), "records": len(records),
            "billed_equals_sum_of_records": sum(r.unit_us for r in records) == meter.billed_unit_us,
            "billed_plus_idle_equals_wall": meter.billed_unit_us + meter.idle_unit_us == meter.wall_unit_us,
            "unit": info.unit, "num_units": info.num_compute_units}


def pulse_check(seconds: int) -> dict:
    """The service under a pulse, deadline vs fifo, when the pulse tool and the service's packages are here."""
    try:
        from services.client import pulse  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"pulse tool or its packages unavailable: {exc}"}
    return {"skipped": f"run `zeroqueue pulse --compare --duration {seconds}` on this machine (see BENCHMARKS.md)"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU and a tiny model; no CUDA graph capture")
    parser.add_argument("--pulse-seconds", type=int, default=60)
    args = parser.parse_args()
    dry = args.dry_run or not torch.cuda.is_available()
    device, shape = ("cpu", TINY) if dry else ("cuda", SMOLLM2)
    batches, speed_batches, tokens = ([1, 4], [1, 4], 16) if dry else ([1, 8, 32], [1, 8, 32, 128], 64)
    report = Report(Path(os.environ.get("OUT") or ROOT / "bench/out/gpu_check"))
    report.data["mode"] = "dry-run (cpu, tiny model)" if dry else "gpu"
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = load_checkpoint(write_checkpoint(Path(tmp) / "model", shape), "bfloat16")
        report.data["model"] = {"shape": shape, "parameters": ckpt.args.num_parameters, "dtype": "bfloat16"}
        report.section("device", lambda: device_facts(device))
        report.section("correctness", lambda: greedy_graph_vs_eager(ckpt, device, batches, max(batches), tokens))
        report.section("speed", lambda: decode_speed(ckpt, device, speed_batches, 8 if dry else 64))
        report.section("metering", lambda: metering_check(ckpt, device, batches[-1], tokens))
        report.section("pulse", lambda: pulse_check(args.pulse_seconds))
    report.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report.save()
    failed = [k for k, v in report.data.items() if isinstance(v, dict) and "error" in v]
    report.log(f"report: {report.out / 'gpu_check.json'}; failed sections: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
