"""Qwen2-MoE (`qwen2_moe`: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) and OLMoE (`olmoe`: OLMoE-1B-7B) checkpoints: the engine
computes what transformers computes on the same random-weight checkpoint, read from the same config.json.

Qwen2-MoE is Qwen2's attention (q/k/v biased unless qkv_bias says false) with Qwen3-MoE's layers: sparse by
decoder_sparse_step and mlp_only_layers, routed by a float32 softmax's top-k (renormalized by norm_topk_prob), and
beside the routed experts one shared expert of its own width (shared_expert_intermediate_size) whose output is
weighed by the sigmoid of shared_expert_gate's logit. With use_sliding_window, every other layer below
max_window_layers attends a window. OLMoE norms q and k over their whole projections, all heads together (OLMo 2's
norms, the weights multiplying the row rounded to the model's dtype), in Llama's layer, every MLP a mixture of experts
routed as Qwen2-MoE's. Both are published as one tensor per expert, saved by transformers stacked. Prompts are chunked
and batched beside decode rows, on the C decode loop and on the torch path, at tp=2 + ep=2, and from a compressed copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import load_config, parse_config
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import SMALL, save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, check_compressed_copy, check_decode_path,
                                        parallel_engines_fixture, save_per_expert, variant_fixture)
from tests.engine.test_mechanics import make_engine
from tests.engine.test_parallel import PROMPT, assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# 4 experts, top-2, experts 32 wide; Qwen2-MoE's shared expert 48 wide (not a multiple of an expert's width)
QWEN2_MOE = {**SMALL, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 48}
OLMOE = {**SMALL, "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "eos_token_id": 2}


def _qwen2_moe(**kw):
    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**{**QWEN2_MOE, **kw}))
    with torch.no_grad():   # shared gates' logits far from 0, so that each token's gate is its own
        for layer in model.model.layers:
            if hasattr(layer.mlp, "shared_expert_gate"):
                layer.mlp.shared_expert_gate.weight.normal_(0, 0.5)
    return model


def _olmoe(**kw):
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**{**OLMOE, **kw}))


VARIANTS = {
    # Qwen1.5-MoE-A2.7B's shape, small: every layer sparse, top-2 unrenormalized, q/k/v biased as its config (which
    # names no qkv_bias) leaves them by default
    "qwen2-moe": (_qwen2_moe, {"qkv_bias": None}),
    # layer 0 dense by decoder_sparse_step 2, the top-2 renormalized, layer 0 attending a window of 8
    "qwen2-moe-sparse-step": (lambda: _qwen2_moe(decoder_sparse_step=2, norm_topk_prob=True, use_sliding_window=True,
                                                 sliding_window=8, max_window_layers=1), {}),
    # OLMoE-1B-7B's shape, small: q/k norms over the whole projections, top-2 unrenormalized, no biases
    "olmoe": (_olmoe, {}),
    # every attention projection biased, the top-2 renormalized
    "olmoe-biases": (lambda: _olmoe(attention_bias=True, norm_topk_prob=True), {}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "qwen2-moe-sparse-step",
                      "the decode paths differ in attention only, which one variant covers")


def test_config_is_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg, their = load_config(directory), reference.config
    layers = reference.model.layers
    assert cfg.moe.sparse_layers == [hasattr(layer.mlp, "experts") for layer in layers]
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.norm_topk_prob) == (
        their.num_experts, their.num_experts_per_tok, their.norm_topk_prob)
    attention = layers[0].self_attn
    assert (cfg.qkv_bias, cfg.o_bias) == (attention.q_proj.bias is not None, attention.o_proj.bias is not None)
    if name.startswith("qwen2"):
        assert cfg.moe.shared_width == their.shared_expert_intermediate_size and cfg.moe.shared_expert_gate
        windows = [their.sliding_window if kind == "sliding_attention" else None for kind in their.layer_types]
        assert cfg.sliding_windows == windows
    else:
        assert cfg.qk_norm_over_heads and attention.q_norm.weight.numel() == cfg.num_heads * cfg.head_dim
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())


def test_the_published_tensor_names_load(variant, tmp_path):
    name, directory, reference = variant
    if name not in ("qwen2-moe", "olmoe"):
        pytest.skip("one checkpoint of each family's")
    save_per_expert(directory, tmp_path / "published")
    names = load_file(tmp_path / "published" / "model.safetensors").keys()
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names and "model.layers.1.mlp.gate.weight" in names
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(make_engine(tmp_path / "published").prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)


def test_a_compressed_copy_gives_the_logits_of_its_original(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["qwen2-moe"])
    check_compressed_copy(original, compressed, weight_modes=("compressed_in_memory",))


parallel_engines = parallel_engines_fixture("qwen2-moe-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_and_expert_parallel_logits_match_transformers(parallel_engines):
    # tp=2 + ep=2: each rank 2 of the 4 experts and half the heads with their bias rows; the router, the shared expert
    # and its gate whole on each
    assert_prompt_logits(parallel_engines, "qwen2-moe", (2, 1, 2), (1, 1, 1))
    # OLMoE's q/k norms over all heads: the ranks' sums of squares all-reduced
    assert_prompt_logits(parallel_engines, "olmoe", (2, 1, 2), (1, 1, 1))


def _raw(factory, **changes) -> dict:
    return {**factory().to_dict(), **changes}


def _qwen2_moe_config():
    return transformers.Qwen2MoeConfig(**QWEN2_MOE)


def _olmoe_config():
    return transformers.OlmoeConfig(**OLMOE)


@pytest.mark.parametrize("factory, changes, error, message", [
    (_qwen2_moe_config, {"qkv_bias": "yes"}, CheckpointError, "qkv_bias must be true or false, got 'yes'"),
    (_qwen2_moe_config, {"shared_expert_intermediate_size": 0}, CheckpointError,
     "shared_expert_intermediate_size must be a positive integer, got 0"),
    (_qwen2_moe_config, {"decoder_sparse_step": 0}, CheckpointError,
     "decoder_sparse_step must be a positive integer, got 0"),
    (_qwen2_moe_config, {"mlp_only_layers": [2]}, CheckpointError,
     r"mlp_only_layers must list layer indices in \[0, 2\), got \[2\]"),
    (_qwen2_moe_config, {"num_experts_per_tok": 5}, CheckpointError, "num_experts_per_tok 5 exceeds the 4 experts"),
    (_qwen2_moe_config, {"norm_topk_prob": "true"}, CheckpointError, "norm_topk_prob must be true or false"),
    (_qwen2_moe_config, {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["sliding_attention"]},
     CheckpointError, r"layer_types must list one attention type per layer \(2\)"),
    (_qwen2_moe_config, {"use_sliding_window": True, "sliding_window": 8, "layer_types": None,
      "max_window_layers": -1}, CheckpointError,
     "max_window_layers must be a non-negative integer, got -1"),
    (_olmoe_config, {"clip_qkv": 8.0}, UnsupportedModelError, "clip_qkv 8.0 is not supported for olmoe"),
    (_olmoe_config, {"head_dim": 32}, CheckpointError, r"head_dim must be hidden_size / num_attention_heads \(16"),
    (_olmoe_config, {"num_experts": 0}, CheckpointError, "num_experts must be a positive integer, got 0"),
    (_olmoe_config, {"attention_bias": 1}, CheckpointError, "attention_bias must be true or false, got 1"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(factory, changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(factory, **changes), Path("config.json"))


def _assert_defaults(cfg, their) -> None:
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads) == (their.vocab_size, their.hidden_size, their.intermediate_size,
                                  their.num_hidden_layers, their.num_attention_heads, their.num_key_value_heads)
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        their.rope_parameters["rope_theta"], their.rope_parameters["rope_type"], their.rms_norm_eps,
        their.max_position_embeddings)
    assert (cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (
        their.tie_word_embeddings, their.bos_token_id, [] if their.eos_token_id is None else [their.eos_token_id])
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.norm_topk_prob) == (
        their.num_experts, their.num_experts_per_tok, their.norm_topk_prob)


def test_omitted_fields_default_as_transformers_defaults_them():
    cfg, their = parse_config({"model_type": "qwen2_moe"}, Path("config.json")), transformers.Qwen2MoeConfig()
    _assert_defaults(cfg, their)
    assert (cfg.moe.intermediate_size, cfg.moe.shared_width) == (
        their.moe_intermediate_size, their.shared_expert_intermediate_size)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.sliding_windows) == (True, False, [None] * their.num_hidden_layers)
    assert all(cfg.moe.sparse_layers) and len(cfg.moe.sparse_layers) == their.num_hidden_layers
    # with use_sliding_window alone: every other layer below max_window_layers (28) attends 4096 tokens
    windowed = transformers.Qwen2MoeConfig(use_sliding_window=True)
    assert parse_config({"model_type": "qwen2_moe", "use_sliding_window": True}, Path("c")).sliding_windows == [
        windowed.sliding_window if kind == "sliding_attention" else None for kind in windowed.layer_types]
    cfg, their = parse_config({"model_type": "olmoe"}, Path("config.json")), transformers.OlmoeConfig()
    _assert_defaults(cfg, their)
    assert (cfg.moe.intermediate_size, cfg.qkv_bias, cfg.o_bias, cfg.moe.num_shared_experts) == (
        their.intermediate_size, False, False, 0)
