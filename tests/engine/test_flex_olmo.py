"""FlexOlmo checkpoints (`flex_olmo`: FlexOlmo-7x7B-1T, the Flex-*-2x7B-1T): the engine computes what transformers
computes on the same random-weight checkpoint, read from the same config.json.

FlexOlmo is OLMo 2's layer (each attention and MLP output normed before its residual add, neither input; q_norm and
k_norm RMSNorms over the whole q and k projections, all heads together; the norms' weights multiplying the float32 row)
whose every MLP is OLMoE's mixture of experts: a float32 softmax over the router's logits, its top-k (renormalized by
norm_topk_prob), q/k/v/o biased by attention_bias. The published checkpoints route every token to every expert
(num_experts_per_tok = num_experts). The first variant is FlexOlmo-7x7B-1T's config shrunk, every other key kept.
Prompts are chunked and batched beside decode rows, on the C decode loop and on the torch path, at tp=2 + ep=2, from
the published one-tensor-per-expert layout, and from a compressed copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import parse_config
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, assert_shape_as_transformers, check_compressed_copy,
                                        check_decode_path, parallel_engines_fixture, save_per_expert,
                                        sharp_logits_check, variant_fixture)
from tests.engine.test_mechanics import make_engine
from tests.engine.test_parallel import PROMPT, assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# allenai/FlexOlmo-7x7B-1T's config.json, its keys and values as a public FlexOlmo audit's sweep of the Hub's configs
# tabulates them (the Flex-*-2x7B-1T ones differ in 2 experts, top-2, and carry "clip_qkv": null, which transformers
# does not read)
FLEX_OLMO_7X7B = {"architectures": ["FlexOlmoForCausalLM"], "model_type": "flex_olmo", "vocab_size": 100352,
                  "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 32, "hidden_act": "silu", "max_position_embeddings": 4096,
                  "rms_norm_eps": 1e-6, "rope_theta": 500000, "rope_scaling": None, "attention_bias": False,
                  "attention_dropout": 0.0, "num_experts": 7, "num_experts_per_tok": 7, "norm_topk_prob": False,
                  "tie_word_embeddings": False, "bos_token_id": 100257, "eos_token_id": 100257,
                  "pad_token_id": 100277, "use_cache": True, "dtype": "float32"}
# ... shrunk, every other key kept: 4 heads of 16 (MHA, as published), 4 experts of 32 all routed (as published),
# weights 5x the default scale, token ids within the tiny vocabulary
FLEX_OLMO_TINY = {**FLEX_OLMO_7X7B, "vocab_size": 320, "hidden_size": 64, "intermediate_size": 32,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                  "max_position_embeddings": 512, "num_experts": 4, "num_experts_per_tok": 4,
                  "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
PUBLISHED_SPELLING = {"rope_theta": FLEX_OLMO_7X7B["rope_theta"], "rope_scaling": None}


def _flex_olmo(**kw):
    config = {key: value for key, value in {**FLEX_OLMO_TINY, **kw}.items()
              if key not in ("rope_theta", "rope_scaling")}
    rope = {"rope_type": "default", "rope_theta": FLEX_OLMO_7X7B["rope_theta"]}
    return transformers.FlexOlmoForCausalLM(transformers.FlexOlmoConfig(**{"rope_parameters": rope, **config}))


VARIANTS = {
    # FlexOlmo-7x7B-1T's config shrunk, spelled as published (a top-level rope_theta, a null rope_scaling)
    "flex-olmo-7x7b": (_flex_olmo, PUBLISHED_SPELLING),
    # 2 KV heads (one per rank at tp=2), q/k/v/o biased, top-2 of 4 renormalized, tied embeddings, the 2x7B configs'
    # clip_qkv key
    "flex-olmo-gqa": (lambda: _flex_olmo(num_key_value_heads=2, attention_bias=True, num_experts_per_tok=2,
                                         norm_topk_prob=True, tie_word_embeddings=True),
                      {**PUBLISHED_SPELLING, "clip_qkv": None}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "flex-olmo-gqa",
                      "the decode paths differ in attention only, which one variant covers")


def test_config_is_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg = parse_config(json.loads((directory / "config.json").read_text()), directory / "config.json")
    their, layer = reference.config, reference.model.layers[0]
    assert (cfg.sandwich_norms, cfg.input_norms, cfg.qk_norm, cfg.qk_norm_over_heads, cfg.norms_in_float32) == (
        True, False, True, True, True)
    assert not hasattr(layer, "input_layernorm") and hasattr(layer, "post_feedforward_layernorm")
    assert layer.self_attn.q_norm.weight.numel() == cfg.num_heads * cfg.head_dim
    assert layer.self_attn.k_norm.weight.numel() == cfg.num_kv_heads * cfg.head_dim
    assert (cfg.qkv_bias, cfg.o_bias) == (layer.self_attn.q_proj.bias is not None,
                                          layer.self_attn.o_proj.bias is not None)
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.norm_topk_prob, cfg.moe.intermediate_size) == (
        their.num_experts, their.num_experts_per_tok, their.norm_topk_prob, their.intermediate_size)
    assert cfg.moe.sparse_layers == [True] * their.num_hidden_layers and cfg.moe.num_shared_experts == 0
    assert (cfg.rope.theta, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (
        their.rope_parameters["rope_theta"], their.rms_norm_eps, their.tie_word_embeddings)
    assert cfg.sliding_windows == [None] * their.num_hidden_layers
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())


def test_the_published_config_is_read_as_transformers_reads_it():
    cfg = parse_config(FLEX_OLMO_7X7B, Path("config.json"))
    their = transformers.FlexOlmoConfig(**{k: v for k, v in FLEX_OLMO_7X7B.items() if k != "model_type"})
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.vocab_size, cfg.max_position_embeddings) == (
        their.hidden_size, their.num_hidden_layers, their.num_attention_heads, their.num_key_value_heads, 128,
        their.intermediate_size, their.vocab_size, their.max_position_embeddings)
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rms_norm_eps, cfg.torch_dtype) == (
        their.rope_parameters["rope_type"], their.rope_parameters["rope_theta"], their.rms_norm_eps, "float32")
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.norm_topk_prob) == (7, 7, False)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.tie_word_embeddings, cfg.qkv_bias) == (
        their.bos_token_id, [their.eos_token_id], False, False)
    # a 2x7B domain checkpoint's: two experts, both routed, a null clip_qkv
    cfg = parse_config({**FLEX_OLMO_7X7B, "num_experts": 2, "num_experts_per_tok": 2, "clip_qkv": None}, Path("c"))
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok) == (2, 2)


def test_the_published_tensor_names_load(variant, tmp_path):
    name, directory, reference = variant
    if name != "flex-olmo-7x7b":
        pytest.skip("one checkpoint's tensors")
    # as published: one tensor per expert projection (transformers saves them stacked), norms after each block
    save_per_expert(directory, tmp_path / "published")
    names = load_file(tmp_path / "published" / "model.safetensors").keys()
    assert {"model.layers.1.mlp.experts.3.up_proj.weight", "model.layers.1.mlp.gate.weight",
            "model.layers.1.post_attention_layernorm.weight", "model.layers.1.post_feedforward_layernorm.weight",
            "model.layers.1.self_attn.q_norm.weight"} <= names
    assert not any("input_layernorm" in n for n in names)
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(make_engine(tmp_path / "published").prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)


def test_what_sets_flex_olmo_apart_moves_the_logits_far_from_transformers(variant):
    # the logits check is sharp: without either norm of the outputs (OLMoE's layer norms neither), or with the q/k norms
    # over each head, the same weights are far from transformers' logits. (Renormalizing the top-k or not scales each
    # token's experts' sum alone, which the norm of the MLP's output undoes.)
    engine, far_after = sharp_logits_check(variant, 0.1)
    layers, cfg = engine.model.weights.layers, engine.model.config

    def per_head_qk_norms(patch):
        patch.setattr(cfg, "qk_norm_over_heads", False)
        for layer in layers:
            patch.setattr(layer, "q_norm", layer.q_norm.view(-1, cfg.head_dim)[0])
            patch.setattr(layer, "k_norm", layer.k_norm.view(-1, cfg.head_dim)[0])

    assert far_after(lambda patch: [patch.setattr(layer, "attn_out_norm", None) for layer in layers])
    assert far_after(lambda patch: [patch.setattr(layer, "mlp_out_norm", None) for layer in layers])
    assert far_after(per_head_qk_norms)


def test_a_compressed_copy_gives_the_logits_of_its_original(tmp_path):
    # every layer's MLP is experts (which compressed_in_memory would expand at load): decoded as they are read
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["flex-olmo-7x7b"])
    check_compressed_copy(original, compressed, weight_modes=("decompress_on_load",))


parallel_engines = parallel_engines_fixture("flex-olmo-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_and_expert_parallel_logits_match_transformers(parallel_engines):
    # tp=2 + ep=2: each rank 2 of the 4 query heads and 1 of the 2 KV heads with their bias rows, the q/k norms' sums of
    # squares all-reduced over the ranks, 2 of the 4 experts; the router whole on each
    assert_prompt_logits(parallel_engines, "flex-olmo-gqa", (2, 1, 2), (1, 1, 1))


def _raw(**changes) -> dict:
    return {**FLEX_OLMO_TINY, **changes}


@pytest.mark.parametrize("changes, error, message", [
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
    ({"num_experts_per_tok": 5}, CheckpointError, "num_experts_per_tok 5 exceeds the 4 experts"),
    ({"num_experts": 0}, CheckpointError, "num_experts must be a positive integer, got 0"),
    ({"norm_topk_prob": "true"}, CheckpointError, "norm_topk_prob must be true or false"),
    ({"attention_bias": 1}, CheckpointError, "attention_bias must be true or false, got 1"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, UnsupportedModelError, "rope type 'longrope'"),
    ({"num_key_value_heads": 3}, CheckpointError, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    cfg, their = parse_config({"model_type": "flex_olmo"}, Path("config.json")), transformers.FlexOlmoConfig()
    assert_shape_as_transformers(cfg, their, 128)
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        their.rope_parameters["rope_type"], their.rope_parameters["rope_theta"], their.rms_norm_eps,
        their.max_position_embeddings)
    assert (cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (
        their.tie_word_embeddings, their.bos_token_id, [their.eos_token_id])
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.norm_topk_prob, cfg.moe.intermediate_size) == (
        their.num_experts, their.num_experts_per_tok, their.norm_topk_prob, their.intermediate_size)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.moe.num_shared_experts) == (False, False, 0)
