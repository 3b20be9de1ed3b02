"""Every way a checkpoint directory can be broken gets one CheckpointError naming the file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.inference.device.loader import CheckpointError, load_checkpoint


@pytest.fixture
def ckpt(tmp_path, llama_dir):
    target = tmp_path / "ckpt"
    shutil.copytree(llama_dir, target)
    return target


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def expect_error(path, file_name, *fragments):
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert info.value.path.endswith(file_name), info.value.path
    for fragment in fragments:
        assert fragment in str(info.value)
    return info.value


def test_good_checkpoint_loads(ckpt):
    checkpoint = load_checkpoint(ckpt)
    assert checkpoint.args.num_hidden_layers == 2 and checkpoint.eos_token_ids == (0,)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file(ckpt, name):
    (ckpt / name).unlink()
    expect_error(ckpt, name, "missing")


def test_not_a_directory(tmp_path):
    expect_error(tmp_path / "nope", "nope", "not a directory")


def test_unsupported_model_type(ckpt):
    edit_config(ckpt, model_type="gpt2")
    expect_error(ckpt, "config.json", "unsupported model_type 'gpt2'")


def test_unsupported_rope_type(ckpt):
    edit_config(ckpt, rope_parameters={"rope_type": "yarn", "factor": 2.0})
    expect_error(ckpt, "config.json", "unsupported rope type 'yarn'")


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    expect_error(ckpt, "config.json", "not valid JSON")


def test_config_missing_key(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    del config["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(config))
    expect_error(ckpt, "config.json", "hidden_size")


def test_mismatched_tensor_shape(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 100)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    expect_error(ckpt, "model.safetensors", "model.layers.1.mlp.down_proj.weight", "(64, 100)", "(64, 160)")


def test_config_disagrees_with_weights(ckpt):
    edit_config(ckpt, intermediate_size=200)
    expect_error(ckpt, "model.safetensors", "mlp.gate_proj.weight")


def test_missing_tensor(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    expect_error(ckpt, "ckpt", "missing tensors: model.norm.weight")


def test_corrupt_safetensors(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    expect_error(ckpt, "model.safetensors", "cannot read safetensors")


def test_garbage_safetensors_header(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    expect_error(ckpt, "model.safetensors", "cannot read safetensors")


def test_corrupt_tokenizer(ckpt):
    (ckpt / "tokenizer.json").write_text('{"model": 3}')
    expect_error(ckpt, "tokenizer.json", "cannot parse tokenizer")


def test_shard_named_in_index_is_missing(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    index = {
        "weight_map": {
            "model.norm.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
        }
    }
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_error(ckpt, "model-00002-of-00002.safetensors", "shard", "missing")


def test_unsupported_dtype(ckpt):
    with pytest.raises(CheckpointError, match="unsupported dtype 'int8'"):
        load_checkpoint(ckpt, dtype="int8")


def test_eos_from_tokenizer_config_when_configs_have_none(ckpt):
    edit_config(ckpt, eos_token_id=None)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    gen.pop("eos_token_id", None)
    (ckpt / "generation_config.json").write_text(json.dumps(gen))
    assert load_checkpoint(ckpt).eos_token_ids == (0,)
