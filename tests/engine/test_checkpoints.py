"""Bad checkpoints fail at load with an error that names the file or field at fault."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError

CONFIG = EngineConfig(kv_cache_bytes=4 << 20, show_progress=False)


@pytest.fixture
def copy(llama_checkpoint, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(llama_checkpoint[0], target)
    return target


def test_missing_directory():
    with pytest.raises(CheckpointError, match="does not exist"):
        LLMEngine("/nonexistent/model", CONFIG)


def test_missing_config(copy):
    (copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        LLMEngine(copy, CONFIG)


def test_corrupt_config(copy):
    (copy / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        LLMEngine(copy, CONFIG)


def test_missing_weights(copy):
    (copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        LLMEngine(copy, CONFIG)


def test_corrupt_weights(copy):
    path = copy / "model.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage-header" + b"\x00" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors: unreadable"):
        LLMEngine(copy, CONFIG)


def test_truncated_weights(copy):
    path = copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLMEngine(copy, CONFIG)


def test_missing_tensor(copy):
    from safetensors.torch import load_file, save_file
    tensors = load_file(copy / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        LLMEngine(copy, CONFIG)


def test_shape_disagrees_with_config(copy):
    config = json.loads((copy / "config.json").read_text())
    config["intermediate_size"] = 96
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="gate_proj.weight.*shape"):
        LLMEngine(copy, CONFIG)


def test_unsupported_architecture(copy):
    config = json.loads((copy / "config.json").read_text())
    config["model_type"] = "gpt2"
    config["architectures"] = ["GPT2LMHeadModel"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*supported: deepseek_v3, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe"):
        LLMEngine(copy, CONFIG)


def test_missing_shard_named_by_index(copy):
    (copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors, which is missing"):
        LLMEngine(copy, CONFIG)
