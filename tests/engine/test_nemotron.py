"""Nemotron checkpoints (`nemotron`: Nemotron-4, Minitron, Nemotron-Mini): the engine computes what transformers
computes on the same random-weight checkpoint, read from the same config.json.

Nemotron's norms are LayerNorms with a bias that scale by 1 + weight (LayerNorm1P; eps: norm_eps), its rotary turns
only each head's first partial_rotary_factor of dims (half unless the config says otherwise), and its MLP has no gate:
up_proj activated by ReLU squared into down_proj (biased with mlp_bias, as q/k/v/o are with attention_bias). Prompts are
chunked and batched beside decode rows on the C decode loop and on the torch path; the 4B's shape also runs at tp=2 and
from a compressed copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.compression.streamed import StreamedLayers
from engine.config import parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, check_compressed_copy, check_decode_path,
                                        parallel_engines_fixture, sharp_logits_check, variant_fixture)
from tests.engine.test_parallel import assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# Nemotron-4 4B's config.json (Minitron-4B's shape, as quoted by TensorRT-LLM's tests/unittest/_torch/modeling/
# test_modeling_nemotron.py); kv_channels is a key transformers does not read
NEMOTRON_4B = {"architectures": ["NemotronForCausalLM"], "bos_token_id": 2, "eos_token_id": 3, "hidden_act": "relu2",
               "hidden_size": 3072, "initializer_range": 0.0134, "intermediate_size": 9216,
               "max_position_embeddings": 4096, "model_type": "nemotron", "num_attention_heads": 24,
               "num_hidden_layers": 32, "num_key_value_heads": 8, "norm_eps": 1e-05, "rope_theta": 10000,
               "partial_rotary_factor": 0.5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
               "transformers_version": "4.48.0", "use_cache": True, "vocab_size": 256000, "kv_channels": 128}
# ... shrunk: tiny sizes, every other key kept; a small rope theta, so that rotating all of a head, or none, moves the
# logits far
SHAPE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "intermediate_size": 96, "vocab_size": 320, "max_position_embeddings": 512, "kv_channels": 16,
         "initializer_range": 0.1, "torch_dtype": "float32", "rope_theta": 100}
NEMOTRON_TINY = {**NEMOTRON_4B, **SHAPE}


def _nemotron(**kw):
    return transformers.NemotronForCausalLM(transformers.NemotronConfig(**{**NEMOTRON_TINY, **kw}))


VARIANTS = {
    # the 4B's shape, small: GQA, untied, half of each 16-dim head rotating, no biases; its config as published
    "nemotron-4b": (_nemotron, {"rope_parameters": None, "rope_theta": 100, "partial_rotary_factor": 0.5}),
    # every projection biased, tied, 24-dim heads (not hidden_size / heads), of which the rope's parameters turn 3/4
    "nemotron-biases": (lambda: _nemotron(attention_bias=True, mlp_bias=True, tie_word_embeddings=True, head_dim=24,
                                          rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                                                           "partial_rotary_factor": 0.75}), {}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "nemotron-4b",
                      "the decode paths differ in attention only, which one variant covers")


def test_config_is_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg = parse_config(json.loads((directory / "config.json").read_text()), directory / "config.json")
    their, layer = reference.config, reference.model.layers[0]
    assert (cfg.gated_mlp, cfg.hidden_act, cfg.layer_norms, cfg.norm_bias, cfg.norm_weight_offset) == (
        False, "relu2", True, True, True)
    assert cfg.rms_norm_eps == their.norm_eps == layer.input_layernorm.eps
    assert cfg.rotary_dim == reference.model.rotary_emb.inv_freq.numel() * 2 < cfg.head_dim == their.head_dim
    assert cfg.mlp_bias == (layer.mlp.up_proj.bias is not None)
    assert (cfg.qkv_bias, cfg.o_bias) == (layer.self_attn.q_proj.bias is not None,
                                          layer.self_attn.o_proj.bias is not None)
    assert cfg.tie_word_embeddings == their.tie_word_embeddings
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())


def test_the_published_config_is_read_as_transformers_reads_it():
    cfg, their = parse_config(NEMOTRON_4B, Path("config.json")), transformers.NemotronConfig(**NEMOTRON_4B)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, cfg.intermediate_size,
            cfg.vocab_size, cfg.max_position_embeddings) == (
        their.hidden_size, their.num_attention_heads, their.num_key_value_heads, their.head_dim,
        their.num_hidden_layers, their.intermediate_size, their.vocab_size, their.max_position_embeddings)
    rope = their.rope_parameters
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rotary_dim) == (
        rope["rope_type"], rope["rope_theta"], int(their.head_dim * rope["partial_rotary_factor"]))
    assert (cfg.rms_norm_eps, cfg.bos_token_id, cfg.eos_token_ids, cfg.torch_dtype) == (
        their.norm_eps, their.bos_token_id, [their.eos_token_id], "bfloat16")


def test_what_sets_nemotron_apart_moves_the_logits_far_from_transformers(variant):
    # the logits check is sharp: with norms scaling by the weight alone, without their biases, with every dim of a head
    # rotated, or with the MLP's ReLU not squared, the same weights are far from transformers' logits
    engine, far_after = sharp_logits_check(variant, 0.1, after=lambda: engine.model._build_rope(64, 64))
    model = engine.model

    def norms(patch, change):
        for layer in model.weights.layers:
            for norm in ("input_norm", "post_norm", "input_norm_bias", "post_norm_bias"):
                patch.setattr(layer, norm, change(norm, getattr(layer, norm)))

    assert far_after(lambda patch: norms(patch, lambda norm, weight: weight if "bias" in norm else weight - 1))
    assert far_after(lambda patch: norms(patch, lambda norm, weight: torch.zeros_like(weight) if "bias" in norm
                                         else weight))

    def rotate_all(patch):
        patch.setattr(model, "rotary_dim", model.config.head_dim)
        model._build_rope(64, 64)

    assert far_after(rotate_all)
    assert far_after(lambda patch: patch.setattr(model.ops, "relu_squared", torch.relu))


def test_a_compressed_copy_gives_transformers_logits_in_both_weight_modes(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["nemotron-4b"])
    check_compressed_copy(original, compressed)
    # compressed_in_memory kept every layer's ungated MLP (up_proj alone, then down_proj) compressed
    engine = LLMEngine(compressed, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, dtype="float32",
                                                block_size=8, weight_mode="compressed_in_memory"))
    layers = engine.model.weights.layers
    assert isinstance(layers, StreamedLayers) and layers.num_compressed == len(layers) == 2
    assert [tuple(t.shape) for t in layers.mlps[0].gate_up] == [(96, 64)] and layers[0].gate_up.shape == (96, 64)


parallel_engines = parallel_engines_fixture("nemotron-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_parallel_logits_match_transformers(parallel_engines):
    # 4 heads and 2 KV heads over 2 ranks, each rotating half of its heads' dims; the norms whole on each rank
    assert_prompt_logits(parallel_engines, "nemotron-4b", (2, 1), (1, 1))
    # biased: up_proj's bias rows split with its rows, down_proj's and o_proj's added once after the all-reduce
    assert_prompt_logits(parallel_engines, "nemotron-biases", (2, 1), (1, 1))


def _raw(**changes) -> dict:
    return {**NEMOTRON_TINY, **changes}


@pytest.mark.parametrize("changes, error, message", [
    ({"hidden_act": "silu"}, UnsupportedModelError,
     "hidden_act 'silu' is not supported for nemotron .supported: relu2"),
    ({"norm_eps": 0}, CheckpointError, "norm_eps must be a positive number, got 0"),
    ({"partial_rotary_factor": 0}, CheckpointError, r"partial_rotary_factor must be a number in \(0, 1\], got 0"),
    ({"partial_rotary_factor": 0.1}, UnsupportedModelError, "partial_rotary_factor 0.1 leaves 1 of the 16 head dims"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, UnsupportedModelError, "rope type 'longrope'"),
    ({"attention_bias": "yes"}, CheckpointError, "attention_bias must be true or false, got 'yes'"),
])
def test_nemotron_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    cfg, their = parse_config({"model_type": "nemotron"}, Path("config.json")), transformers.NemotronConfig()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.head_dim) == (
        their.vocab_size, their.hidden_size, their.intermediate_size, their.num_hidden_layers,
        their.num_attention_heads, their.head_dim)
    rope = their.rope_parameters
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rotary_dim, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        rope["rope_theta"], rope["rope_type"], int(their.head_dim * rope["partial_rotary_factor"]), their.norm_eps,
        their.max_position_embeddings)
    assert (cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids, cfg.hidden_act) == (
        their.tie_word_embeddings, their.bos_token_id, [their.eos_token_id], their.hidden_act)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (False, False, False)
    # transformers leaves num_key_value_heads None (and builds no attention then): one KV head per query head here
    assert their.num_key_value_heads is None and cfg.num_kv_heads == their.num_attention_heads
    # the top level's partial_rotary_factor, when the rope's parameters give none
    cfg = parse_config({"model_type": "nemotron", "partial_rotary_factor": 0.25, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0}}, Path("config.json"))
    assert cfg.rotary_dim == 32
