"""The GPU path, checked on a real device: CUDA-graph replay, sampling, speed, SM·µs and the engine process.

    bash bench/gpu_run.sh                  # on the lent H200: carried wheels, environment, then this script
    python bench/gpu_check.py              # on a machine with an NVIDIA GPU (made for one H200, < 6 min)
    python bench/gpu_check.py --dry-run    # on CPU with a tiny model: every step but the graph capture

Without CUDA and without --dry-run it exits 2 (a GPU run that found no GPU is a failed run). Writes
gpu_check.json and gpu_check.log under $OUT when set, else bench/out/gpu_check/, after every part. All on
plain torch (the CPU kernels are never the GPU's code), a SmolLM2-135M-shaped random model in bf16:

1. environment: python, torch, CUDA, cuDNN, the device (SMs from torch and NVML, MIG, memory, driver);
2. greedy: 64 tokens from the graph engine vs the eager engine at batch 1, 8 and 32, mixed prompt lengths;
3. replay: a graph replay vs the same padded forward run eagerly (bitwise), after a chunked prefill;
4. sampling: sample() from the same logits on the device and on the host, default temperature and filters;
5. logits: the first step's logits on the device vs plain torch on the CPU, a few prompts;
6. speed: decode tokens/s with graphs vs eager at batch 1, 8, 32, 128, each step against a floor of the
   bytes it reads (weights and KV cache);
6b. fp8: FP8 (E4M3) weights against bf16 on the device: logits parity within a stated tolerance, greedy agreement,
   decode tokens/s with graphs at batch 1, 8, 32 and SM·µs per token (bench/gpu_fp8.py);
7. kernels: the attention kernels (and the top kernels) of one graph replay and one eager step, profiled;
8. metering: CUDA-event step time vs a host clock, and the per-request SM·µs split conserving every step;
9. engine_process: the engine spawned as `zeroqueue serve` runs it, on the device, calibrated, serving two
   greedy and two default-temperature calls with their SM·µs usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "bench")]

import gpu_parts as parts  # noqa: E402
from gpu_fp8 import fp8_check  # noqa: E402
from gpu_watchdog import watchdog_check  # noqa: E402

from services.inference.device.executor import ExecutorConfig, describe_device  # noqa: E402
from services.inference.device.loader import load_checkpoint  # noqa: E402
from services.inference.device.nvml import gpu_facts  # noqa: E402
from services.inference.engine.client import EngineClient  # noqa: E402
from services.inference.engine.messages import EngineSpec  # noqa: E402
from services.inference.meter import Meter, RecordContext  # noqa: E402
from services.inference.sched.request import Request, SamplingParams  # noqa: E402
from services.logs import configure_logging  # noqa: E402

SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)
PARTS = (
    "environment",
    "greedy",
    "replay",
    "sampling",
    "logits",
    "speed",
    "fp8",
    "kernels",
    "metering",
    "watchdog",
    "engine_process",
)


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
        """Runs one part, which fills the dict it is given; a failure keeps what it filled, adds the trace,
        and the next part still runs."""
        t0 = time.monotonic()
        self.log(f"--- {name}")
        self.data[name] = result = {}
        try:
            run(result)
        except Exception as exc:  # noqa: BLE001 - a report that says what failed beats no report
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["trace"] = traceback.format_exc()
        self.data[name + "_seconds"] = round(time.monotonic() - t0, 1)
        self.log(json.dumps(result, indent=1)[:4000])
        self.save()

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=2))

    @property
    def failed(self) -> list[str]:
        return [k for k, v in self.data.items() if isinstance(v, dict) and "error" in v]


def write_checkpoint(root: Path, shape: dict, seed: int = 0, std: float = 0.08) -> Path:
    """A random Llama checkpoint in the Hugging Face layout, bf16; a larger init than usual keeps the
    logits peaked, so greedy comparisons are not decided by near-ties."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    g = torch.Generator().manual_seed(seed)
    h, inter, kv = shape["hidden_size"], shape["intermediate_size"], shape["num_key_value_heads"]
    head_dim = h // shape["num_attention_heads"]
    rand = lambda *dims: (torch.randn(*dims, generator=g) * std).to(torch.bfloat16)  # noqa: E731
    tensors = {"model.embed_tokens.weight": rand(shape["vocab_size"], h), "model.norm.weight": torch.ones(h).bfloat16()}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(h, h),
            p + "self_attn.k_proj.weight": rand(kv * head_dim, h),
            p + "self_attn.v_proj.weight": rand(kv * head_dim, h),
            p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h).bfloat16(),
            p + "post_attention_layernorm.weight": torch.ones(h).bfloat16(),
        }
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "eos_token_id": 0,
        "rope_theta": 10000.0,
        **shape,
    }
    (root / "config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
    tokenizer.train_from_iterator(
        ["def f(x):\n    return x * 2\n"] * 50,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer.save(str(root / "tokenizer.json"))
    return root


def environment(out: dict, device: str) -> None:
    cudnn = torch.backends.cudnn
    out |= {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn.version() if cudnn.is_available() else None,
        "host": platform.node(),
        "device": describe_device(torch.device(device)).__dict__,
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        nvml = gpu_facts(str(props.uuid))
        out |= {
            "sm_count_torch": props.multi_processor_count,
            "memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
            "nvml": nvml.__dict__ if nvml else None,
        }


def metering_check(out: dict, ckpt, device: str, batch: int, tokens: int) -> None:
    engine = parts.make_engine(ckpt, device, batch, graphs=True)
    records: list = []
    now_ns, epoch = engine.clock(), 1_800_000_000_000_000
    meter = Meter(
        engine.executor.info,
        "random",
        "gpucheck",
        lambda ns: (ns - now_ns) // 1000 + epoch,
        lambda usage, idle: records.extend(b() for b in usage),
        started_ns=now_ns,
    )
    reports: list = []
    engine.observers.append(meter)
    for i in range(batch):
        meter.register(f"m-{i}", RecordContext("gpucheck", {}, now_ns, now_ns, now_ns + 10**15))
    parts.add_calls(engine, parts.Sink(), "m", batch, tokens, seed=batch)
    parts.run_all(engine, reports)
    steps = [r for r in reports if r.result is not None]
    ratios = [r.result.device_time_us / max(r.interval_ns / 1000, 1) for r in steps]
    out |= {
        "steps": len(steps),
        "device_over_host_time_median": round(statistics.median(ratios), 3),
        "device_over_host_time_min": round(min(ratios), 3),
        "records": len(records),
        "billed_equals_sum_of_records": sum(r.unit_us for r in records) == meter.billed_unit_us,
        "billed_plus_idle_equals_wall": meter.billed_unit_us + meter.idle_unit_us == meter.wall_unit_us,
        "unit": meter.device.unit,
        "num_units": meter.device.num_units,
    }


async def _serve(out: dict, model_dir: Path, device: str, max_tokens: int) -> None:
    spec = EngineSpec(
        str(model_dir), "bfloat16", ExecutorConfig(device=device, max_batch=8, max_seq_len=256, use_kernels=False), 256
    )
    client, t0 = EngineClient(spec, time.monotonic_ns), time.monotonic()
    ready = await asyncio.to_thread(client.launch)  # spawned, warmed up and calibrated
    out |= {
        "launch_s": round(time.monotonic() - t0, 1),
        "device": ready.device.__dict__,
        "slots": ready.num_slots,
        "calibrated_rows": list(ready.cost_rows),
        "calibrated_row_us": [round(u) for u in ready.cost_row_us],
    }
    records, sink, done = {}, parts.Sink(), asyncio.Event()
    start_ns, start_us = time.monotonic_ns(), time.time_ns() // 1000
    epoch_us = lambda ns: start_us + (ns - start_ns) // 1000  # noqa: E731

    def write(usage, idle) -> None:
        for build in usage:
            record = build()
            records[record.call_id] = record
        if len(records) == 4:
            done.set()

    client.observers.append(Meter(ready.device, "random", "gpucheck", epoch_us, write, started_ns=start_ns))
    client.start()
    meter = client.observers[-1]
    for i, (name, temperature) in enumerate(
        [("greedy-0", 0.0), ("greedy-1", 0.0), ("default-0", 1.0), ("default-1", 1.0)]
    ):
        now_ns = time.monotonic_ns()
        meter.register(name, RecordContext("gpucheck", {}, now_ns, now_ns, now_ns + 60 * 10**9))
        prompt = tuple(range(5 + i, 25 + 3 * i))
        client.add_request(
            Request(
                name,
                prompt,
                SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, ignore_eos=True),
                time.monotonic_ns(),
            ),
            sink,
        )
    await asyncio.wait_for(done.wait(), 120)
    await asyncio.to_thread(client.stop)
    out["calls"] = {
        name: {
            "tokens": len(sink.tokens.get(name, [])),
            "finish_reason": sink.finish.get(name),
            "outcome": r.outcome,
            "unit": r.unit,
            "unit_us": r.unit_us,
            "num_units": r.num_units,
        }
        for name, r in sorted(records.items())
    }


def engine_process_check(out: dict, model_dir: Path, device: str, max_tokens: int) -> None:
    asyncio.run(_serve(out, model_dir, device, max_tokens))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU and a tiny model; no CUDA graph capture")
    parser.add_argument("--only", nargs="+", choices=PARTS, help="run these parts alone")
    args = parser.parse_args()
    report = Report(Path(os.environ.get("OUT") or ROOT / "bench/out/gpu_check"))
    if not args.dry_run and not torch.cuda.is_available():
        report.data["error"] = "no CUDA device: torch.cuda.is_available() is False (on a CPU, use --dry-run)"
        report.save()
        report.log(report.data["error"])
        return 2
    dry = args.dry_run
    device, shape = ("cpu", TINY) if dry else ("cuda", SMOLLM2)
    batches, speed_batches, tokens = ([1, 4], [1, 4], 16) if dry else ([1, 8, 32], [1, 8, 32, 128], 64)
    report.data["mode"] = "dry-run (cpu, tiny model)" if dry else "gpu"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(Path(tmp) / "model", shape)
        ckpt = load_checkpoint(model_dir, "bfloat16")
        report.data["model"] = {"shape": shape, "parameters": ckpt.args.num_parameters, "dtype": "bfloat16"}
        runs = {
            "environment": lambda out: environment(out, device),
            "greedy": lambda out: parts.greedy_graph_vs_eager(out, ckpt, device, batches, tokens),
            # the largest batch's prompts take several steps of prefill, and some of its calls end during it
            "replay": lambda out: parts.replay_vs_static(out, ckpt, device, [1, 4, 32] if dry else batches),
            "sampling": lambda out: parts.sampling_vs_cpu(out, device, shape["vocab_size"]),
            "logits": lambda out: parts.logits_vs_cpu(out, ckpt, device),
            "speed": lambda out: parts.decode_speed(out, ckpt, device, speed_batches, 8 if dry else 64),
            "fp8": lambda out: fp8_check(out, ckpt, device, batches, 8 if dry else 64),
            "kernels": lambda out: parts.kernels_used(out, ckpt, device),
            "metering": lambda out: metering_check(out, ckpt, device, batches[-1], tokens),
            "watchdog": lambda out: watchdog_check(out, ckpt, device, batches[-1], tokens),
            "engine_process": lambda out: engine_process_check(out, model_dir, device, tokens),
        }
        for name in args.only or PARTS:
            report.section(name, runs[name])
    report.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report.save()
    report.log(f"report: {report.out / 'gpu_check.json'}; failed parts: {report.failed or 'none'}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    configure_logging()  # every line on stderr: stdout is the bench's report
    sys.exit(main())
