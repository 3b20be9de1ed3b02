"""Pre-quantized int8 checkpoints (issue 34): `zeroqueue quantize` writes compressed-tensors' int-quantized layout;
the loader reads it, its int8 weights exactly what load-time quantization of the original gives, so a replica serves
it bit for bit as `--quantize int8` on the original, without the original; what the format does not allow is a
CheckpointError that names the file and the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.cli import main
from services.inference.device import kernels
from services.inference.device.checkpoint import CheckpointError
from services.inference.device.int8_writer import write_int8_checkpoint
from services.inference.device.loader import load_checkpoint
from services.inference.device.quant import quantize_int8
from tests.inference.conftest import make_engine
from tests.inference.logits import prompt_logits
from tests.inference.test_decode_layers import wide_heads_dir  # noqa: F401 - a fixture

TOKENS = list(range(3, 40))
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def quantized(request, wide_heads_dir, tmp_path_factory):  # noqa: F811
    """(the original's directory, the pre-quantized copy's, the dtype both are served in)."""
    out = write_int8_checkpoint(wide_heads_dir, tmp_path_factory.mktemp("q") / "int8", request.param)
    return wide_heads_dir, out, request.param


def test_the_copy_holds_int8_weights_with_per_channel_scales(quantized):
    _, out, dtype = quantized
    tensors = load_file(out / "model.safetensors")
    q, scale = tensors["model.layers.0.mlp.down_proj.weight"], tensors["model.layers.0.mlp.down_proj.weight_scale"]
    assert q.dtype == torch.int8 and scale.shape == (q.shape[0], 1) and scale.dtype == torch.float32
    assert tensors["model.embed_tokens.weight"].dtype == getattr(torch, dtype)  # the rest as a float checkpoint
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["format"] == "int-quantized" and config["torch_dtype"] == dtype
    assert (out / "tokenizer.json").is_file()


def test_it_loads_exactly_as_load_time_quantization_of_the_original(quantized):
    original, out, dtype = quantized
    stored, plain = load_checkpoint(out, dtype), load_checkpoint(original, dtype)
    assert stored.header.quantization == "int8" and not plain.int8
    for i in range(3):
        for linear in LINEARS:
            name = f"layers.{i}.{linear}.weight"
            q, scale = quantize_int8(plain.state_dict[name])  # what --quantize int8 does at load time
            assert torch.equal(stored.int8[name][0], q) and torch.equal(stored.int8[name][1], scale), name


@pytest.mark.skipif(kernels.load_cpu_ops() is None, reason=f"{kernels.reason_unavailable()}")
def test_a_replica_serves_it_bit_for_bit_as_quantize_int8_on_the_original(quantized):
    original, out, dtype = quantized
    from_copy = make_engine(out, dtype=dtype)  # no --quantize: the checkpoint says int8
    assert from_copy.executor.quantize == "int8"
    on_original = make_engine(original, dtype=dtype, quantize="int8")
    assert torch.equal(prompt_logits(from_copy.executor, TOKENS), prompt_logits(on_original.executor, TOKENS))


def test_the_command_prints_the_new_directory_and_refuses_an_existing_one(wide_heads_dir, tmp_path, capsys):  # noqa: F811
    assert main(["quantize", str(wide_heads_dir), str(tmp_path / "q8")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'q8'}\n"  # stdout is the result alone
    assert main(["quantize", str(wide_heads_dir), str(tmp_path / "q8")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "exists" in captured.err


def _rewrite(out, edit) -> None:
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda t: t.pop("model.layers.1.self_attn.o_proj.weight_scale"), "has no .*o_proj.weight_scale"),
        (lambda t: t.update({"model.norm.weight_scale": torch.ones(1)}), "scales no int8 tensor model.norm.weight"),
        (
            lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale": torch.ones(3, 1)}),
            r"has shape \(3, 1\), expected \[\d+, 1\]",
        ),
        (
            lambda t: t["model.layers.0.mlp.up_proj.weight_scale"].__setitem__(0, float("nan")),
            "not positive and finite",
        ),
    ],
    ids=["missing scale", "stray scale", "scale shape", "nan scale"],
)
def test_a_broken_copy_is_refused_naming_the_tensor(wide_heads_dir, tmp_path, edit, problem):  # noqa: F811
    out = write_int8_checkpoint(wide_heads_dir, tmp_path / "q8")
    _rewrite(out, edit)
    with pytest.raises(CheckpointError, match=problem):
        load_checkpoint(out)


@pytest.mark.parametrize(
    ("quantization_config", "problem"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "format 'float-quantized'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "symmetric": True}}},
            },
            "is not int8 symmetric per channel",
        ),
    ],
    ids=["gptq", "fp8", "int4"],
)
def test_a_quantization_it_does_not_serve_is_named(wide_heads_dir, tmp_path, quantization_config, problem):  # noqa: F811
    out = write_int8_checkpoint(wide_heads_dir, tmp_path / "q8")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"config.json: quantization_config: .*{problem}"):
        load_checkpoint(out)
