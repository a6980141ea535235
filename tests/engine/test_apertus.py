"""Apertus checkpoints (`apertus`: Apertus-8B, -70B): the engine computes what transformers computes on the same
random-weight checkpoint, read from the same config.json.

Apertus is Llama's decoder whose q and k are RMS-normed over each head before the rotary, whose norms are named
attention_layernorm and feedforward_layernorm, and whose MLP has no gate: up_proj activated by xIELU into down_proj.
xIELU's parameters are learned per layer (mlp.act_fn.alpha_p, alpha_n, beta, eps): positive inputs give
softplus(alpha_p) x^2 + beta x, the others (expm1(min(x, eps)) - x) (beta + softplus(alpha_n)) + beta x. Each
layer's parameters here are drawn apart, eps far from 0, so that another layer's, or transformers' initial ones, move
the logits.
Without rope_parameters or rope_scaling the rope is transformers' llama3 one at 12M, whatever rope_theta says. Prompts
are chunked and batched beside decode rows on the C decode loop and on the torch path; the 8B's shape also runs at tp=2
and from a compressed copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import APERTUS_ROPE, parse_config
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, assert_shape_as_transformers, check_compressed_copy,
                                        check_decode_path, parallel_engines_fixture, sharp_logits_check,
                                        variant_fixture)
from tests.engine.test_mechanics import make_engine
from tests.engine.test_parallel import assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# swiss-ai/Apertus-8B's config.json (as quoted by a public MLX port's TestParseConfigApertus8B); qk_norm and post_norm
# are keys transformers does not read
APERTUS_8B = {"architectures": ["ApertusForCausalLM"], "model_type": "apertus", "dtype": "bfloat16",
              "hidden_size": 4096, "intermediate_size": 21504, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "max_position_embeddings": 65536, "rope_theta": 12000000,
              "rope_scaling": {"factor": 8, "high_freq_factor": 4, "low_freq_factor": 1,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3", "type": "llama3"},
              "hidden_act": "xielu", "qk_norm": True, "post_norm": False, "attention_bias": False, "mlp_bias": False,
              "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "vocab_size": 131072}
# ... shrunk: tiny sizes (the rope's original context and theta too, so that llama3's scaling moves these prompts),
# every other key kept
ROPE = {**APERTUS_8B["rope_scaling"], "original_max_position_embeddings": 16}
APERTUS_TINY = {**APERTUS_8B, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rope_theta": 200,
                "rope_scaling": ROPE, "vocab_size": 320, "dtype": "float32", "initializer_range": 0.1,
                "bos_token_id": 1, "eos_token_id": 2}


def _apertus(**kw):
    config = {key: value for key, value in {**APERTUS_TINY, **kw}.items() if key not in ("rope_theta", "rope_scaling")}
    rope = {**ROPE, "rope_theta": APERTUS_TINY["rope_theta"]}
    model = transformers.ApertusForCausalLM(transformers.ApertusConfig(**{"rope_parameters": rope, **config}))
    with torch.no_grad():   # each layer's xIELU its own (transformers starts every layer at the same values)
        for layer in model.model.layers:
            act = layer.mlp.act_fn
            act.alpha_p.normal_(0, 1)
            act.alpha_n.normal_(0, 1)
            act.beta.copy_(0.5 + 0.2 * torch.randn(()))
            act.eps.copy_(-0.5 * torch.rand(()))
    return model


VARIANTS = {
    # the 8B's shape, small: GQA, untied, llama3's rope spelled as published (top-level rope_theta beside rope_scaling)
    "apertus-8b": (_apertus, {"rope_theta": APERTUS_TINY["rope_theta"], "rope_scaling": ROPE}),
    # q/k/v/o biased, tied, and no rope given beside a top-level rope_theta: transformers' llama3 rope at 12M
    "apertus-default-rope": (lambda: _apertus(attention_bias=True, tie_word_embeddings=True,
                                              rope_parameters=APERTUS_ROPE),
                             {"rope_parameters": None, "rope_scaling": None, "rope_theta": 500000}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "apertus-8b",
                      "the decode paths differ in attention only, which one variant covers")


def _act_parameters(reference) -> int:
    return sum(b.numel() for name, b in reference.named_buffers() if ".act_fn." in name)


def test_config_is_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg = parse_config(json.loads((directory / "config.json").read_text()), directory / "config.json")
    their, attention = reference.config, reference.model.layers[0].self_attn
    assert (cfg.gated_mlp, cfg.hidden_act, cfg.qk_norm, cfg.qk_norm_over_heads, cfg.mlp_bias) == (
        False, "xielu", True, False, False)
    assert attention.q_norm.weight.numel() == cfg.head_dim == their.hidden_size // their.num_attention_heads
    assert (cfg.qkv_bias, cfg.o_bias) == (attention.q_proj.bias is not None, attention.o_proj.bias is not None)
    rope = their.rope_parameters
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == (
        rope["rope_type"], rope["rope_theta"], rope["factor"], rope["original_max_position_embeddings"])
    assert cfg.tie_word_embeddings == their.tie_word_embeddings
    # the learned alpha_p and alpha_n are parameters, beta and eps buffers: all four stored, and kept
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters()) + _act_parameters(reference)


def test_the_published_config_is_read_as_transformers_reads_it():
    cfg, their = parse_config(APERTUS_8B, Path("config.json")), transformers.ApertusConfig(**APERTUS_8B)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, cfg.intermediate_size,
            cfg.vocab_size, cfg.max_position_embeddings) == (
        their.hidden_size, their.num_attention_heads, their.num_key_value_heads, 128, their.num_hidden_layers,
        their.intermediate_size, their.vocab_size, their.max_position_embeddings)
    rope = their.rope_parameters
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor, cfg.rope.low_freq_factor, cfg.rope.high_freq_factor,
            cfg.rope.original_max_position_embeddings) == (
        rope["rope_type"], rope["rope_theta"], rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
        rope["original_max_position_embeddings"])
    assert (cfg.rms_norm_eps, cfg.torch_dtype, cfg.hidden_act) == (their.rms_norm_eps, "bfloat16", "xielu")


def test_what_sets_apertus_apart_moves_the_logits_far_from_transformers(variant):
    # the logits check is sharp: without the q/k norms, with the layers' xIELU parameters swapped or reset to
    # transformers' initial ones, or with another ungated activation, the same weights are far from transformers' logits
    engine, far_after = sharp_logits_check(variant, 0.1)
    layers = engine.model.weights.layers

    def drop_qk_norms(patch):
        for layer in layers:
            patch.setattr(layer, "q_norm", None)
            patch.setattr(layer, "k_norm", None)

    initial = torch.tensor([0.8, 0.8, 0.5, -1e-6])   # softplus(alpha_p), beta + softplus(alpha_n), beta, eps as built
    assert far_after(drop_qk_norms)
    assert far_after(lambda patch: [patch.setattr(layer, "act_params", initial) for layer in layers])
    assert far_after(lambda patch: [patch.setattr(layer, "act_params", other.act_params)
                                    for layer, other in zip(layers, layers[::-1])])
    assert far_after(lambda patch: patch.setattr(engine.model.ops, "xielu", lambda up, params: torch.square(up.relu())))


def test_the_activation_s_stored_parameters_are_required(variant, tmp_path):
    name, directory, reference = variant
    if name != "apertus-8b":
        pytest.skip("one checkpoint's tensors")
    tensors = load_file(directory / "model.safetensors")
    assert {"model.layers.1.mlp.act_fn.alpha_p", "model.layers.1.mlp.act_fn.alpha_n", "model.layers.1.mlp.act_fn.beta",
            "model.layers.1.mlp.act_fn.eps", "model.layers.1.attention_layernorm.weight",
            "model.layers.1.feedforward_layernorm.weight", "model.layers.1.self_attn.q_norm.weight"} <= tensors.keys()
    # transformers leaves a missing beta uninitialized: the engine refuses the checkpoint rather than guess it
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.act_fn.beta"},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.act_fn.beta'"):
        make_engine(tmp_path)


def test_a_compressed_copy_gives_transformers_logits_in_both_weight_modes(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["apertus-8b"])
    check_compressed_copy(original, compressed)


parallel_engines = parallel_engines_fixture("apertus-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_parallel_logits_match_transformers(parallel_engines):
    # 4 heads and 2 KV heads over 2 ranks, each head normed alone; each rank its half of up_proj's rows, xIELU's
    # parameters whole on each
    assert_prompt_logits(parallel_engines, "apertus-8b", (2, 1), (1, 1))


def _raw(**changes) -> dict:
    return {**APERTUS_TINY, **changes}


@pytest.mark.parametrize("changes, error, message", [
    ({"hidden_act": "relu2"}, UnsupportedModelError,
     "hidden_act 'relu2' is not supported for apertus .supported: xielu"),
    ({"qk_norm": False}, UnsupportedModelError, "qk_norm false is not supported for apertus .only true"),
    ({"post_norm": True}, UnsupportedModelError, "post_norm true is not supported for apertus .only false"),
    ({"partial_rotary_factor": 0.5}, UnsupportedModelError,
     "partial_rotary_factor below 1 is not supported for apertus"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, UnsupportedModelError, "rope type 'longrope'"),
    ({"rms_norm_eps": -1}, CheckpointError, "rms_norm_eps must be a positive number, got -1"),
])
def test_apertus_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    cfg, their = parse_config({"model_type": "apertus"}, Path("config.json")), transformers.ApertusConfig()
    assert_shape_as_transformers(cfg, their, 128)
    rope = their.rope_parameters
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == (
        rope["rope_type"], rope["rope_theta"], rope["factor"], rope["original_max_position_embeddings"])
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.tie_word_embeddings, cfg.bos_token_id,
            cfg.eos_token_ids, cfg.hidden_act) == (their.rms_norm_eps, their.max_position_embeddings,
                                                   their.tie_word_embeddings, their.bos_token_id, [their.eos_token_id],
                                                   their.hidden_act)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.qk_norm) == (False, False, False, True)
    # a rope_scaling without its theta: transformers' default theta for Apertus, 12M
    cfg = parse_config({"model_type": "apertus", "rope_scaling": {"rope_type": "default"}}, Path("config.json"))
    their = transformers.ApertusConfig(rope_scaling={"rope_type": "default"})
    assert (cfg.rope.rope_type, cfg.rope.theta) == (their.rope_parameters["rope_type"],
                                                    their.rope_parameters["rope_theta"])
