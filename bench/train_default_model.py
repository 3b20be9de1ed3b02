"""Trains zq-python-tiny, the model `make serve` ships with, from nothing but this machine's Python.

Corpus: the *.py sources of the running interpreter's standard library (`sysconfig.get_paths()["stdlib"]`),
sorted by path, without test suites, test data, idlelib, encodings' generated code-page tables, pydoc's topic
dump and site-packages. A seeded sample of files is held out for evaluation. The shipped model was trained on
CPython 3.11.7's stdlib; another Python version (or a distribution that patches the stdlib) yields a slightly
different corpus and therefore a slightly different model. With the same interpreter, torch version, thread
count and seed, the corpus, tokenizer, data order and initial weights are identical, and two runs on one machine
give bit-identical weights (checked); another CPU may differ in the last bits through its kernels' reduction order.

Tokenizer: byte-level BPE trained with `tokenizers` on the training files; `<|endoftext|>` separates files and is
the model's EOS. Model: transformers' `LlamaForCausalLM` (a training-only dependency), AdamW with linear warm-up
and cosine decay, saved in bfloat16 in the Hugging Face layout our loader reads.

    nice -n 10 .venv/bin/python bench/train_default_model.py --seed 0 --threads 2 --steps 1800 --minutes 50

`--steps` fixes the schedule (and so the result); `--minutes` is a wall-clock cap that ends training early,
recorded in the log and model card when it fires, whose reproduction command then adds `--stop-step N
--minutes 0` to repeat the same cut without a clock.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from default_model_files import EOS, EXCLUDED_DIRS, samples, save_checkpoint, write_model_card
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "services/inference/bundled/zq-python-tiny"


@dataclass(frozen=True)
class Corpus:
    stdlib: Path
    train: list[tuple[str, str]]  # (path relative to stdlib, source)
    heldout: list[tuple[str, str]]


def build_corpus(stdlib: Path, seed: int, num_heldout: int) -> Corpus:
    files = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if EXCLUDED_DIRS & set(rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append((rel.as_posix(), text))
    heldout_idx = set(random.Random(seed).sample(range(len(files)), num_heldout))
    return Corpus(
        stdlib,
        [f for i, f in enumerate(files) if i not in heldout_idx],
        [f for i, f in enumerate(files) if i in heldout_idx],
    )


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def encode_stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """Every file's tokens followed by EOS, concatenated: [N] int64."""
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def unigram_loss(train: torch.Tensor, heldout: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of the held-out tokens under add-one-smoothed training unigram frequencies."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[heldout].mean())


def build_model(args: argparse.Namespace, vocab_size: int, eos_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.seq_len,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.02,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=None,
        attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def make_optimizer(model, args: argparse.Namespace, total_steps: int):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    def lr_factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, total_steps - args.warmup))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


def batch_at(stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B] window starts -> [B, seq_len + 1] token windows."""
    return stream[starts[:, None] + torch.arange(seq_len + 1)[None, :]]


def forward_loss(model, windows: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq_len: int, batch: int, max_tokens: int, autocast: bool) -> float:
    """Mean loss (nats/token) over consecutive non-overlapping windows from the start of `stream`."""
    model.eval()
    n_windows = min((len(stream) - 1) // seq_len, max(1, max_tokens // seq_len))
    starts = torch.arange(n_windows) * seq_len
    total = 0.0
    for i in range(0, n_windows, batch):
        chunk = starts[i : i + batch]
        total += float(forward_loss(model, batch_at(stream, chunk, seq_len), autocast)) * len(chunk)
    model.train()
    return total / n_windows


def train(model, stream: torch.Tensor, heldout: torch.Tensor, args: argparse.Namespace) -> dict:
    opt, sched = make_optimizer(model, args, args.steps)
    gen = torch.Generator().manual_seed(args.seed)
    deadline = time.monotonic() + args.minutes * 60 if args.minutes > 0 else math.inf
    log: dict = {"curve": [], "stopped_by_time_budget": False}
    started, ema, step = time.monotonic(), None, 0
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch,), generator=gen)
        loss = forward_loss(model, batch_at(stream, starts, args.seq_len), args.bf16_autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.monotonic() - started
            point = {
                "step": step,
                "train_loss": round(ema, 4),
                "lr": round(sched.get_last_lr()[0], 7),
                "elapsed_s": round(elapsed, 1),
            }
            if step % args.eval_every == 0 and step > 0:
                point["heldout_loss"] = round(
                    evaluate(model, heldout, args.seq_len, args.batch, args.eval_tokens // 4, args.bf16_autocast), 4
                )
            log["curve"].append(point)
            tok_s = (step + 1) * args.batch * args.seq_len / max(elapsed, 1e-9)
            print(json.dumps(point | {"tokens_per_s": round(tok_s)}), flush=True)
        if args.stop_step is not None and step + 1 >= args.stop_step:
            break
        if time.monotonic() > deadline:
            log["stopped_by_time_budget"] = True
            print(f"time budget of {args.minutes} min reached at step {step}", flush=True)
            break
    log.update(
        steps_done=step + 1,
        train_time_s=round(time.monotonic() - started, 1),
        tokens_seen=(step + 1) * args.batch * args.seq_len,
    )
    return log


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--minutes", type=float, default=50.0, help="wall-clock cap on the training loop; 0: none")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=1800, help="optimizer steps; fixes the lr schedule")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument(
        "--stop-step",
        type=int,
        default=None,
        help="end after this many steps on the --steps schedule (repeats a run --minutes cut short)",
    )
    p.add_argument("--bf16-autocast", action="store_true", help="bf16 autocast for the forward pass")
    p.add_argument("--num-heldout", type=int, default=16, help="stdlib files held out for evaluation")
    p.add_argument("--eval-tokens", type=int, default=65536)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=250)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = build_corpus(stdlib, args.seed, args.num_heldout)
    tokenizer = train_tokenizer([t for _, t in corpus.train], args.vocab_size)
    vocab_size, eos_id = tokenizer.get_vocab_size(), tokenizer.token_to_id(EOS)
    stream = encode_stream(tokenizer, [t for _, t in corpus.train])
    heldout = encode_stream(tokenizer, [t for _, t in corpus.heldout])
    print(
        f"corpus: {len(corpus.train)} train files ({len(stream):,} tokens), {len(corpus.heldout)} held out "
        f"({len(heldout):,} tokens): {', '.join(p for p, _ in corpus.heldout)}",
        flush=True,
    )
    model = build_model(args, vocab_size, eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters, vocab {vocab_size}", flush=True)
    log = train(model, stream, heldout, args)
    final_train = evaluate(model, stream, args.seq_len, args.batch, args.eval_tokens, args.bf16_autocast)
    final_heldout = evaluate(model, heldout, args.seq_len, args.batch, args.eval_tokens, args.bf16_autocast)
    save_checkpoint(model, tokenizer, args.out, args.seq_len)
    size = (args.out / "model.safetensors").stat().st_size
    if size > 25_000_000:
        sys.exit(f"{args.out / 'model.safetensors'} is {size / 1e6:.1f} MB, over the 25 MB budget")
    report = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "seed": args.seed,
        "threads": args.threads,
        "command": "nice -n 10 .venv/bin/python " + " ".join(["bench/train_default_model.py", *(argv or sys.argv[1:])]),
        "shape": {
            k: getattr(args, k)
            for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "seq_len", "batch")
        },
        "vocab_size": vocab_size,
        "num_parameters": n_params,
        "lr": args.lr,
        "warmup": args.warmup,
        "bf16_autocast": args.bf16_autocast,
        "eval_tokens": args.eval_tokens,
        "corpus": {
            "stdlib": str(stdlib),
            "train_files": len(corpus.train),
            "train_tokens": len(stream),
            "heldout_files": len(corpus.heldout),
            "heldout_tokens": len(heldout),
            "heldout_paths": [p for p, _ in corpus.heldout],
        },
        "final_train_loss": round(final_train, 4),
        "heldout_loss": round(final_heldout, 4),
        "heldout_perplexity": round(math.exp(final_heldout), 2),
        "unigram_heldout_loss": round(unigram_loss(stream, heldout, vocab_size), 4),
        "model_safetensors_bytes": size,
    } | log
    cut = f" --stop-step {log['steps_done']} --minutes 0" if log["stopped_by_time_budget"] else ""
    report["reproduce"] = report["command"] + cut
    from transformers import LlamaForCausalLM

    report["samples"] = samples(LlamaForCausalLM.from_pretrained(args.out, dtype=torch.bfloat16), tokenizer)
    (args.out / "training_log.json").write_text(json.dumps(report, indent=1) + "\n")
    write_model_card(args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k not in ("curve", "samples")}, indent=1))
    for s in report["samples"]:
        print(f"--- {s['prompt']!r} T={s['temperature']}\n{s['prompt']}{s['text']}")


if __name__ == "__main__":
    main()
