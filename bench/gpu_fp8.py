"""bench/gpu_check.py's fp8 part (issue 34): FP8 (E4M3) weights against bf16 on the same device, in one run.

- parity: each decoder linear's product (the model's four shapes, random rows) in fp8 against bf16: the largest
  difference over the largest bf16 output must stay under FP8_TOLERANCE; and the first step's logits of a few prompts,
  reported (largest difference, same argmax, top-5 overlap), not judged: a random 30-layer model amplifies any
  rounding (on the CPU, bf16 against fp32 already moves its logits by 0.07-0.15 of the largest, fp8 by 0.6-0.9);
- greedy: 32 tokens of 8 prompts, how many tokens agree before the first difference;
- speed: decode tokens/s with CUDA graphs at each batch, bf16 and fp8, and the SM·µs per token each step cost (its
  CUDA-event time × the device's SMs / the rows it decoded).

The CPU dry run swaps the layers for Fp8Linear itself (torch._scaled_mm runs on the CPU too), so the part is proved
to run before a GPU is lent; its figures say nothing about a GPU."""

from __future__ import annotations

import gpu_parts as parts
import torch

# |fp8 - bf16| / max |bf16| over one linear's outputs: per-channel E4M3 weights and per-row E4M3 activations round each
# factor by up to 1/16 and the errors of a K-term sum partly cancel (the CPU's _scaled_mm: 0.03-0.05 on these shapes)
FP8_TOLERANCE = 0.1


def fp8_check(out: dict, ckpt, device: str, batches: list[int], steps: int, num_prompts: int = 4) -> None:
    if device.startswith("cuda"):
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    bf16, fp8 = (parts.make_engine(ckpt, device, max(batches), graphs=False, quantize=q) for q in ("none", "fp8"))
    worst = linear_parity(out, bf16.executor.model.layers[0], fp8.executor.model.layers[0], device)
    for i, prompt in enumerate(parts.prompts(num_prompts, ckpt.args.vocab_size, seed=200)):
        a, b = parts.first_logits(fp8.executor, prompt), parts.first_logits(bf16.executor, prompt)
        out[f"prompt{i}"] = {
            "relative_max_diff": round(float((a - b).abs().max() / b.abs().max()), 4),
            "same_argmax": int(a.argmax()) == int(b.argmax()),
            "top5_overlap": len(set(a.topk(5).indices.tolist()) & set(b.topk(5).indices.tolist())),
        }
    out["parity"] = {"worst": round(worst, 4), "tolerance": FP8_TOLERANCE, "ok": worst < FP8_TOLERANCE}
    sinks = {name: parts.Sink() for name in ("bf16", "fp8")}
    for name, engine in (("bf16", bf16), ("fp8", fp8)):
        parts.add_calls(engine, sinks[name], "g", 8, 32, seed=201)
        parts.run_all(engine)
    agree = []
    for call, want in sinks["bf16"].tokens.items():
        got = sinks["fp8"].tokens[call]
        agree.append(next((j for j, (x, y) in enumerate(zip(got, want)) if x != y), len(want)))
    out["greedy_tokens_before_first_difference"] = agree
    units = bf16.executor.info.num_units
    for name in ("bf16", "fp8"):
        speed: dict = {}
        parts.decode_speed(
            speed, ckpt, device, batches, steps, quantize="none" if name == "bf16" else name, modes=(True,)
        )
        for batch in batches:
            row = speed[f"graph_b{batch}"]
            row["sm_us_per_token"] = round(row["device_step_ms_median"] * 1e3 * units / batch)
        out[f"speed_{name}"] = speed
    for batch in batches:
        fast, base = out["speed_fp8"][f"graph_b{batch}"], out["speed_bf16"][f"graph_b{batch}"]
        out[f"fp8_over_bf16_b{batch}"] = round(fast["tokens_per_s"] / base["tokens_per_s"], 2)
    if not out["parity"]["ok"]:
        raise AssertionError(
            f"an fp8 linear differs from bf16 by {worst:.3f} of the largest output, over {FP8_TOLERANCE}"
        )


def linear_parity(out: dict, layer, fp8_layer, device: str, rows: int = 8) -> float:
    """Each of the first decoder layer's linears in fp8 against its bf16 self on the same random rows; the worst
    largest difference over the largest bf16 output."""
    gen = torch.Generator().manual_seed(202)
    worst = 0.0
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        dense, quantized = layer.get_submodule(name), fp8_layer.get_submodule(name)
        x = torch.randn(rows, dense.in_features, generator=gen).to(device=device, dtype=torch.bfloat16)
        with torch.inference_mode():
            want, got = dense(x).float(), quantized(x).float()
        diff = float((got - want).abs().max() / want.abs().max())
        out[f"linear_{name}"] = round(diff, 4)
        worst = max(worst, diff)
    return worst
