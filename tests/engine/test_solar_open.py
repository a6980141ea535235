"""Solar Open checkpoints (`solar_open`: Solar-Open-100B): the engine computes what transformers computes on the same
random-weight checkpoint, read from the same config.json.

Solar Open is GLM-4.5's mixture of experts on every layer (transformers reads no first_k_dense_replace): DeepSeek-V3's
sigmoid scores plus a correction bias choosing among the best groups, weighted by those scores renormalized and
scaled, beside n_shared_experts shared experts; under Llama's attention (q/k/v biased by attention_bias, o never, no
q/k norms whatever use_qk_norm says, every dim of a head rotating) with heads of head_dim, 128 unless given, whatever
hidden_size says. One variant is the published config shrunk, its yarn rope included; prompts are chunked and batched
beside decode rows, on the C decode loop and on the torch path, and also run at tp=2 + ep=2 and from a compressed copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from engine import ops
from engine.config import load_config, parse_config
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, check_compressed_copy, check_decode_path,
                                        parallel_engines_fixture, variant_fixture)
from tests.engine.test_parallel import assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# Solar-Open-100B's config.json as third-party ports quote it (upstage/Solar-Open-100B), shrunk, every other key kept:
# 4 heads of 32 over a hidden size of 64 (published: 64 heads of 128 over 4096), 2 KV heads, 8 experts of 32, top-2, a
# yarn rope doubling a 256-token context (published: 65536); weights 5x the default scale so that the attention moves
# the logits. It gives no n_group, topk_group, use_qk_norm nor attention_bias.
YARN = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}
PUBLISHED = {"partial_rotary_factor": 1.0, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "head_dim": 32, "num_key_value_heads": 2, "vocab_size": 320, "intermediate_size": 128,
             "moe_intermediate_size": 32, "rms_norm_eps": 1e-05, "max_position_embeddings": 512, "n_routed_experts": 8,
             "n_shared_experts": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "num_experts_per_tok": 2,
             "tie_word_embeddings": False, "first_k_dense_replace": 0, "eos_token_id": 2, "initializer_range": 0.1}


def _solar(**kw):
    return transformers.SolarOpenForCausalLM(transformers.SolarOpenConfig(**{**PUBLISHED, **kw}))


VARIANTS = {
    # Solar-Open-100B's shape, small, its rope spelled as published (rope_theta and rope_scaling at the top level)
    "solar-open-100b": (lambda: _solar(rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 2.0,
                                                        "original_max_position_embeddings": 256}),
                        {"rope_scaling": YARN, "rope_theta": 1000000}),
    # q/k/v biased, 2 groups of which 1 a token, two shared experts scaled by 2.5; first_k_dense_replace and
    # use_qk_norm given, which transformers does not read (every layer sparse, no q/k norms)
    "solar-open-groups": (lambda: _solar(attention_bias=True, n_group=2, topk_group=1, n_shared_experts=2,
                                         routed_scaling_factor=2.5, first_k_dense_replace=1, use_qk_norm=True,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), {}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "solar-open-groups",
                      "the decode paths differ in attention only, which one variant covers")


def test_config_is_what_transformers_reads(variant):
    """Every layer sparse, biases, heads and rope as transformers builds them, and memory sizing counting every
    parameter (the routing bias buffers included)."""
    name, directory, reference = variant
    cfg, their = load_config(directory), reference.config
    attention = reference.model.layers[0].self_attn
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm) == (attention.q_proj.bias is not None, False, False)
    assert (cfg.head_dim, cfg.rotary_dim) == (attention.head_dim, None) and cfg.head_dim * cfg.num_heads != 64
    rotary = reference.model.rotary_emb
    inv_freq = ops.rope_inv_freq(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
    assert inv_freq.tolist() == pytest.approx(rotary.inv_freq.tolist(), rel=1e-6)
    assert cfg.rope.attention_factor == pytest.approx(rotary.attention_scaling)
    assert cfg.moe.sparse_layers == [hasattr(layer.mlp, "experts") for layer in reference.model.layers] == [True] * 2
    assert (cfg.moe.num_groups, cfg.moe.topk_groups, cfg.moe.num_shared_experts, cfg.moe.routed_scaling_factor) == (
        their.n_group, their.topk_group, their.n_shared_experts, their.routed_scaling_factor)
    bias = sum(b.numel() for n, b in reference.named_buffers() if n.endswith("e_score_correction_bias"))
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters()) + bias


def test_the_published_tensor_names_load(variant):
    # transformers saves them as published: one tensor per expert projection, the correction bias under the router
    name, directory, reference = variant
    names = load_file(directory / "model.safetensors").keys()
    assert {"model.layers.0.mlp.experts.7.gate_proj.weight", "model.layers.0.mlp.gate.e_score_correction_bias",
            "model.layers.0.mlp.shared_experts.down_proj.weight"} <= names


def test_a_compressed_copy_gives_the_logits_of_its_original(tmp_path):
    # every MLP a mixture of experts: compressed_in_memory would keep nothing compressed, so the copy is decoded
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["solar-open-100b"])
    check_compressed_copy(original, compressed, weight_modes=("decompress_on_load",))


parallel_engines = parallel_engines_fixture("solar-open-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_and_expert_parallel_logits_match_transformers(parallel_engines):
    # tp=2 + ep=2: each rank 2 of the 4 query heads and 1 of the 2 KV heads with their bias rows, half the routed
    # experts, the router and the shared experts whole
    assert_prompt_logits(parallel_engines, "solar-open-groups", (2, 1, 2), (1, 1, 1))


def _raw(**changes) -> dict:
    config = transformers.SolarOpenConfig(**PUBLISHED).to_dict()
    config.update(changes)
    return config


ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("changes, error, message", [
    ({"rope_parameters": {**ROPE, "partial_rotary_factor": 0.5}}, UnsupportedModelError,
     "partial_rotary_factor below 1 is not supported for solar_open"),
    ({"rope_parameters": {**ROPE, "partial_rotary_factor": 1.5}}, CheckpointError,
     r"partial_rotary_factor must be a number in \(0, 1\], got 1.5"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}}, UnsupportedModelError,
     "rope type 'longrope' is not supported for solar_open"),
    ({"n_group": 3}, CheckpointError, "n_group 3 must split the 8 routed experts into equal groups"),
    ({"n_group": 2, "topk_group": 3}, CheckpointError, "topk_group 3 exceeds n_group 2"),
    ({"num_experts_per_tok": 9}, CheckpointError, "num_experts_per_tok 9 exceeds the 8 experts"),
    ({"n_shared_experts": -1}, CheckpointError, "n_shared_experts must be a non-negative integer, got -1"),
    ({"attention_bias": 1}, CheckpointError, "attention_bias must be true or false, got 1"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    cfg, their = parse_config({"model_type": "solar_open"}, Path("config.json")), transformers.SolarOpenConfig()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        their.vocab_size, their.hidden_size, their.num_hidden_layers, their.num_attention_heads,
        their.num_key_value_heads, their.head_dim)
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rotary_dim, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        their.rope_parameters["rope_theta"], their.rope_parameters["rope_type"], None, their.rms_norm_eps,
        their.max_position_embeddings)
    assert (cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids, cfg.qkv_bias, cfg.qk_norm) == (
        False, None, [], False, False)
    moe = cfg.moe
    assert moe.sparse_layers == [True] * their.num_hidden_layers
    assert (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size, moe.num_shared_experts, moe.num_groups,
            moe.topk_groups, moe.norm_topk_prob, moe.routed_scaling_factor) == (
        their.n_routed_experts, their.num_experts_per_tok, their.moe_intermediate_size, their.n_shared_experts,
        their.n_group, their.topk_group, their.norm_topk_prob, their.routed_scaling_factor)
