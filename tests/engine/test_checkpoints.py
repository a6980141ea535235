"""Bad checkpoints fail at load with an error that names the file or field at fault."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, DeviceError, UnsupportedModelError

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
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*supported: afmoe, apertus, arcee, cohere, cohere2, cwm, deepseek_v2, deepseek_v3, dots1, ernie4_5, ernie4_5_moe, exaone4, exaone_moe, flex_olmo, gemma2, gemma3, gemma3_text, glm4, glm4_moe, glm4_moe_lite, glm4v, glm4v_moe, gpt_oss, granite, granitemoe, granitemoeshared, hunyuan_v1_dense, hunyuan_v1_moe, llama, llama4, llama4_text, minimax_m2, ministral3, mistral, mistral3, mistral4, mixtral, nanochat, nemotron, olmo2, olmo3, olmoe, phi3, qwen2, qwen2_5_vl, qwen2_moe, qwen2_vl, qwen3, qwen3_moe, qwen3_vl, qwen3_vl_moe, seed_oss, smollm3, solar_open, starcoder2, youtu"):
        LLMEngine(copy, CONFIG)


def test_missing_shard_named_by_index(copy):
    (copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors, which is missing"):
        LLMEngine(copy, CONFIG)


def _edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))


def _edit_tensors(directory, edit):
    from safetensors.torch import load_file, save_file
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")


@pytest.mark.parametrize("changes, message", [
    # bool("false") is True: the model would have run with its embedding as the output projection
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
    (dict(hidden_size="64x"), "hidden_size must be a positive integer, got '64x'"),
    (dict(hidden_size=64.5), "hidden_size must be a positive integer, got 64.5"),
    (dict(num_key_value_heads=0), "num_key_value_heads must be a positive integer, got 0"),
    (dict(max_position_embeddings=0), "max_position_embeddings must be a positive integer, got 0"),
    (dict(rms_norm_eps="small"), "rms_norm_eps must be a positive number, got 'small'"),
    (dict(rope_parameters=None, rope_scaling="llama3"), "rope_scaling must be an object, got 'llama3'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}), "rope_theta must be a positive number"),
    (dict(eos_token_id="12"), "eos_token_id must be a token id or a list of token ids, got '12'"),
    (dict(model_type="mistral", sliding_window="4096"), "sliding_window must be a positive integer, got '4096'"),
])
def test_config_values_of_the_wrong_type_name_the_field(copy, changes, message):
    _edit_config(copy, **changes)
    with pytest.raises(CheckpointError, match=f"config.json: {message}"):
        LLMEngine(copy, CONFIG)


def test_quantized_checkpoints_are_refused(copy):
    _edit_config(copy, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(UnsupportedModelError, match="quantized checkpoints are not supported .*'fp8'"):
        LLMEngine(copy, CONFIG)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.bool])
def test_weights_not_stored_as_floats_are_refused(copy, dtype):
    name = "model.layers.0.mlp.up_proj.weight"
    _edit_tensors(copy, lambda t: t.__setitem__(name, t[name].to(dtype)))
    with pytest.raises(CheckpointError, match=f"'{name}' is stored as {str(dtype).removeprefix('torch.')}"):
        LLMEngine(copy, CONFIG)


def test_a_config_with_fewer_layers_than_the_weights_is_refused(copy):
    _edit_config(copy, num_hidden_layers=1)   # would run one of the two layers
    with pytest.raises(CheckpointError, match="does not account for: 'model.layers.1.input_layernorm.weight'"):
        LLMEngine(copy, CONFIG)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.down_proj.weight_scale_inv",
                                  "vision_tower.patch_embed.weight"])
def test_tensors_the_config_does_not_account_for_are_refused(copy, name):
    _edit_tensors(copy, lambda t: t.__setitem__(name, torch.ones(64)))
    with pytest.raises(CheckpointError, match=f"does not account for: '{name}'"):
        LLMEngine(copy, CONFIG)


def test_stored_rope_frequencies_are_not_weights(copy):
    # older transformers saved each layer's rotary inv_freq buffer; it is recomputed, never loaded
    _edit_tensors(copy, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    LLMEngine(copy, CONFIG)


def test_a_tensor_in_two_weight_files_is_refused(copy):
    from safetensors.torch import save_file
    save_file({"model.norm.weight": torch.zeros(64)}, copy / "zz-extra.safetensors")
    with pytest.raises(CheckpointError, match="'model.norm.weight' is in both model.safetensors and zz-extra.safetensors"):
        LLMEngine(copy, CONFIG)


@pytest.mark.parametrize("weight_map", [{"model.norm.weight": 5}, ["model.safetensors"]])
def test_a_malformed_index_is_refused(copy, weight_map):
    (copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="index.json: weight_map must map each tensor name to a file name"):
        LLMEngine(copy, CONFIG)


def test_tied_config_with_its_own_lm_head_computes_what_transformers_computes(copy):
    from transformers import AutoModelForCausalLM
    _edit_config(copy, tie_word_embeddings=True)   # the checkpoint still stores a distinct lm_head.weight
    prompt = [5, 17, 260, 3, 99, 41, 7, 150]
    reference = AutoModelForCausalLM.from_pretrained(copy).eval()
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(LLMEngine(copy, CONFIG).prompt_logits(prompt), theirs, rtol=1e-4, atol=1e-4)


def _tensors(value, found: dict) -> dict:
    """Every distinct tensor reachable from the loaded model's weights, by id (a tied head is the embedding)."""
    if isinstance(value, torch.Tensor):
        found[id(value)] = value
    elif dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            _tensors(getattr(value, field.name), found)
    elif isinstance(value, list):
        for item in value:
            _tensors(item, found)
    return found


def test_the_memory_check_counts_a_tied_checkpoints_own_lm_head(copy):
    _edit_config(copy, tie_word_embeddings=True)   # the checkpoint still stores a distinct lm_head.weight
    engine = LLMEngine(copy, CONFIG)
    weights = engine.model.weights
    assert weights.lm_head is not weights.embed_tokens   # kept apart, as transformers keeps it
    loaded = sum(t.numel() * t.element_size() for t in _tensors(weights, {}).values())
    assert engine.weight_bytes == loaded


@pytest.mark.parametrize("generation, message", [
    ({"eos_token_id": "2"}, "generation_config.json: eos_token_id must be a token id or a list of token ids"),
    ({"eos_token_id": [2, "3"]}, "generation_config.json: eos_token_id must be a token id or a list of token ids"),
    # the model could never produce it: every answer would run to max_tokens
    ({"eos_token_id": [2, 5000]}, "generation_config.json: eos_token_id 5000 is outside the model's vocabulary"),
])
def test_unusable_eos_token_ids_are_refused(copy, generation, message):
    (copy / "generation_config.json").write_text(json.dumps(generation))
    with pytest.raises(CheckpointError, match=message):
        LLMEngine(copy, CONFIG)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(copy):
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(400)}, unk_token="w0")).save(str(copy / "tokenizer.json"))
    with pytest.raises(CheckpointError, match="tokenizer.json has token ids up to 399, but config.json's vocab_size is 320"):
        LLMEngine(copy, CONFIG)


@pytest.mark.parametrize("device, message", [
    ("cuda", "has no GPU torch can use"),
    ("cuda:64", r"has no GPU torch can use|has \d+ GPU\(s\)"),
    ("tpu", "is not a device torch knows"),
    ("meta", "runs on cpu or cuda devices"),
])
def test_a_device_the_machine_lacks_is_named(tiny_model_dir, device, message):
    """A device the machine does not have is refused naming it, before anything loads (`cuda` on a CPU-only
    host was torch's 'not compiled with CUDA enabled' traceback from deep in the loader)."""
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(DeviceError, match=message):
        LLMEngine(tiny_model_dir, EngineConfig(device=device))
