"""What quantized weights cost in quality (issue 34), measured on the bundled model, not assumed.

1. Per-token negative log-likelihood (nats/token) of the bundled model on the Python files its training held out
   (training_log.json lists them; they are read from this interpreter's standard library, as training read them, and
   a file this Python lacks is named and skipped), in windows of --window tokens, each from position 0.
2. Greedy agreement over a fixed prompt set (the first lines of each held-out file): --new-tokens greedy tokens per
   prompt, against the unquantized model's on the same path: how many prompts give identical text, and the mean
   share of tokens before the first that differs.

Rows, every one through the replica's own executor:
  - kernels bf16 / int8 / int4: what `zeroqueue serve [--quantize int8|int4]` runs on this CPU, on the int path it
    takes (VNNI on AVX-512, which also quantizes x per row; ZQ_LINEAR_INT=convert for the other);
  - plain bf16 / plain int8 per channel: the same on plain torch (quant.py's values, no kernels);
  - plain int8 per group of G inputs, plain int4 per group of G (asymmetric with a per-group minimum, or symmetric
    as quant.quantize_int4), the LM head kept or also int4: candidate schemes, quantized and dequantized in place
    (bench only), so the shipped scheme is chosen by measurement.
The goal (issue 34): NLL within 1 % of bf16 for int8, within 3 % for int4.

    python bench/quant_quality.py [--window 256] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import sysconfig
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from services.inference.bundled_model import default_model  # noqa: E402
from services.inference.device import kernels  # noqa: E402
from services.inference.device.attention import AttentionMetadata  # noqa: E402
from services.inference.device.executor import Executor  # noqa: E402
from services.inference.device.loader import load_checkpoint  # noqa: E402
from services.inference.device.quant import dequantize_int4, quantize_int4  # noqa: E402
from services.inference.device.spec import ExecutorConfig  # noqa: E402
from services.inference.engine.engine import Engine  # noqa: E402
from services.inference.sched.request import Request, SamplingParams  # noqa: E402
from services.logs import configure_logging  # noqa: E402

PROMPT_LINES = 6  # the first lines of each held-out file make its greedy prompt


def heldout_files(model_dir: Path) -> tuple[list[str], list[str]]:
    """(the held-out files' sources that this interpreter's stdlib has, the paths it lacks)."""
    log = json.loads((model_dir / "training_log.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found, missing = [], []
    for rel in log["corpus"]["heldout_paths"]:
        path = stdlib / rel
        (found.append(path.read_text(encoding="utf-8")) if path.is_file() else missing.append(rel))
    return found, missing


def fake_quantize_groups(modules: list[nn.Module], bits: int, group: int, symmetric: bool) -> None:
    """Every nn.Linear weight under `modules` quantized per group of `group` inputs and dequantized in place: int8
    symmetric (-127..127), int4 symmetric (quant.quantize_int4: -8..7) or asymmetric (0..15 with a per-group minimum).
    New tensors: the model's weights are the checkpoint's, which the next row's executor is built from."""
    for linear in (m for module in modules for m in module.modules() if isinstance(m, nn.Linear)):
        w = linear.weight.float()
        g = w.reshape(w.shape[0], -1, group)
        if bits == 4 and symmetric:
            deq = dequantize_int4(*quantize_int4(w, group), torch.float32, group)
        elif bits == 8:
            scale = (g.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
            deq = torch.clamp(torch.round(g / scale), -127, 127) * scale
        else:
            lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
            scale = ((hi - lo) / 15).clamp(min=1e-12)
            deq = torch.clamp(torch.round((g - lo) / scale), 0, 15) * scale + lo
        linear.weight = nn.Parameter(deq.reshape(w.shape).to(linear.weight.dtype), requires_grad=False)


@torch.inference_mode()
def nll(executor: Executor, stream: list[int], window: int) -> float:
    """Mean next-token NLL (nats) over consecutive windows of `stream`, each prefilled from position 0."""
    bs, total, count = executor.kv_cache.block_size, 0.0, 0
    table = torch.arange(-(-window // bs))
    for start in range(0, len(stream) - 1, window):
        tokens = stream[start : start + window + 1]
        n = len(tokens) - 1
        if n < 2:
            break
        meta = AttentionMetadata.prefill(table, bs, 0, n)
        logits = executor.model(torch.tensor(tokens[:n]), meta.positions, torch.arange(n), executor.backend, meta)
        total += float(nn.functional.cross_entropy(logits, torch.tensor(tokens[1:]), reduction="sum"))
        count += n
    return total / count


def greedy(engine: Engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    sampling = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outputs: dict[str, list[int]] = {}

    class Sink:
        def put(self, output) -> None:
            outputs.setdefault(output.call_id, []).extend(output.token_ids)

    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"p{i}", tuple(prompt), sampling, engine.clock()), Sink())
    while engine.has_work:
        engine.step()
    return [outputs[f"p{i}"] for i in range(len(prompts))]


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """(prompts whose tokens are identical, mean share of tokens before the first difference)."""
    shares = []
    for got, want in zip(tokens, reference):
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        shares.append(same / len(want))
    return sum(s == 1.0 for s in shares), sum(shares) / len(shares)


def variants(groups: list[int]) -> list[tuple[str, dict, tuple | None]]:
    """(row name, ExecutorConfig fields, (bits, group, symmetric, LM head too) of a bench-only fake quantization or
    None)."""
    ops = kernels.load_cpu_ops()
    path = f", {ops.int_path}" if ops else ""  # VNNI also quantizes x per row (kernels.choose_int_path)
    rows = [
        ("kernels bf16", {}, None),
        (f"kernels int8 (per channel{path})", {"quantize": "int8"}, None),
        (f"kernels int4 (g64, head int8{path})", {"quantize": "int4"}, None),
        ("plain bf16", {"use_kernels": False}, None),
        ("plain int8 per channel", {"use_kernels": False, "quantize": "int8"}, None),
        ("plain int4 (g64, head int8)", {"use_kernels": False, "quantize": "int4"}, None),
    ]
    rows += [(f"plain int8 g{g}", {"use_kernels": False}, (8, g, True, False)) for g in groups]
    rows += [(f"plain int4 g{g} asym", {"use_kernels": False}, (4, g, False, False)) for g in groups]
    rows += [(f"plain int4 g{g} sym", {"use_kernels": False}, (4, g, True, False)) for g in groups]
    rows += [(f"plain int4 g{g} sym, head int4", {"use_kernels": False}, (4, g, True, True)) for g in groups]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=256, help="tokens per NLL window (the model's context is 512)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--groups", default="32,64,128", help="group sizes of the candidate schemes")
    args = parser.parse_args()
    configure_logging(level=logging.WARNING)
    torch.manual_seed(0)
    model_dir = default_model()
    checkpoint = load_checkpoint(model_dir)
    sources, missing = heldout_files(model_dir)
    if missing:
        print(f"held-out files this Python lacks, skipped: {', '.join(missing)}", file=sys.stderr)
    tok, eos = checkpoint.tokenizer, checkpoint.eos_token_ids[0]
    stream = [t for text in sources for t in (*tok.encode(text).ids, eos)]
    prompts = [tok.encode("".join(text.splitlines(keepends=True)[:PROMPT_LINES])).ids for text in sources]
    results, references = [], {}
    for name, fields, fake in variants([int(g) for g in args.groups.split(",")]):
        executor = Executor(checkpoint, ExecutorConfig(max_batch=len(prompts), max_seq_len=512, **fields))
        if fake is not None:
            with torch.inference_mode():
                bits, group, symmetric, head = fake
                modules = [executor.model.layers, *([executor.model.lm_head] if head else [])]
                fake_quantize_groups(modules, bits, group, symmetric)
        engine = Engine(executor, tok, checkpoint.eos_token_ids)
        tokens = greedy(engine, prompts, args.new_tokens)
        path = name.split()[0]
        references.setdefault(path, tokens)  # the first row of each path is its unquantized reference
        results.append((name, nll(executor, stream, args.window), *agreement(tokens, references[path])))
    base = {path: next(r[1] for r in results if r[0].startswith(path)) for path in references}
    print(
        f"\n{len(sources)} held-out files, {len(stream):,} tokens, windows of {args.window}; greedy: {len(prompts)} "
        f"prompts x {args.new_tokens} tokens against the same path's bf16\n"
    )
    print("| weights | NLL nats/token | vs bf16 | prompts identical | mean share before first difference |")
    print("|---|---:|---:|---:|---:|")
    for name, loss, identical, share in results:
        ratio = loss / base[name.split()[0]] - 1
        print(f"| {name} | {loss:.4f} | {ratio:+.2%} | {identical}/{len(prompts)} | {share:.0%} |")


if __name__ == "__main__":
    main()
