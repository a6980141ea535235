"""Hunyuan checkpoints (`hunyuan_v1_dense`: Hunyuan-0.5B/1.8B/4B/7B-Instruct; `hunyuan_v1_moe`: Hunyuan-A13B-Instruct):
the engine computes what transformers computes on the same random-weight checkpoint, read from the same config.json.

Hunyuan is Llama's decoder whose q and k are RMS-normed over each head after the rotary (query_layernorm,
key_layernorm; Qwen3's come before it), with q/k/v/o biases by attention_bias. Its published configs say a rope of
type "dynamic" with an alpha, which stretches the rotary base once: rope_theta * alpha ** (head_dim / (head_dim - 2)).
A13B's every MLP is a mixture of experts: a float32 router's softmax, its moe_topk best renormalized (moe_topk may
list one per layer), beside one shared MLP (shared_mlp), all intermediate_size wide; published as one tensor per
expert, saved by transformers stacked. Prompts are chunked and batched beside decode rows, on the C decode loop and on
the torch path, at tp=2 (+ ep=2), and from a compressed copy.
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

# Heads 24 wide (hidden_size / num_attention_heads is 16)
HUNYUAN = {**SMALL, "head_dim": 24, "rope_parameters": {"rope_type": "default", "rope_theta": 300.0}}
# The published configs' spelling: rope_theta at the top level, a "dynamic" rope_scaling with an alpha (and yarn's
# keys, which nothing reads), the embeddings tied; alpha 3 on a base of 300 keeps the rotation visible over 47 tokens
PUBLISHED_SPELLING = {"rope_parameters": None, "rope_theta": 300.0, "tie_word_embeddings": True,
                      "rope_scaling": {"alpha": 3.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                                       "mscale_all_dim": 1.0, "type": "dynamic"}}


def _hunyuan(**kw):
    return transformers.HunYuanDenseV1ForCausalLM(transformers.HunYuanDenseV1Config(**{**HUNYUAN, **kw}))


def _hunyuan_moe(**kw):
    config = transformers.HunYuanMoEV1Config(**{**HUNYUAN, "num_experts": 4, "moe_topk": 2, **kw})
    model = transformers.HunYuanMoEV1ForCausalLM(config)
    with torch.no_grad():   # routers' logits far apart, so that float rounding never flips a token's top-k
        for layer in model.model.layers:
            layer.mlp.gate.wg.weight.copy_(0.5 * torch.randn_like(layer.mlp.gate.wg.weight))
    return model


VARIANTS = {
    # Hunyuan-7B-Instruct's shape, small: no biases, tied embeddings, the alpha-stretched rope
    "hunyuan": (lambda: _hunyuan(tie_word_embeddings=True), PUBLISHED_SPELLING),
    # every attention projection biased, untied embeddings, the default rope
    "hunyuan-biases": (lambda: _hunyuan(attention_bias=True), {}),
    # Hunyuan-A13B's shape, small: 4 experts, top-2 listed per layer as published, the alpha-stretched rope
    "hunyuan-moe": (lambda: _hunyuan_moe(moe_topk=[2, 2]), {**PUBLISHED_SPELLING, "tie_word_embeddings": False}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "hunyuan",
                      "the decode paths differ in attention only, which one variant covers")


def test_config_is_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg, their = load_config(directory), reference.config
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.qk_norm_after_rope) == (
        their.attention_bias, their.attention_bias, True, True)
    rotary = reference.model.rotary_emb
    assert (cfg.head_dim, cfg.tie_word_embeddings) == (their.head_dim, their.tie_word_embeddings)
    assert cfg.rope.theta ** -(2 / cfg.head_dim) == pytest.approx(rotary.inv_freq[1].item(), rel=1e-6)
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())


def test_the_published_tensor_names_load(variant, tmp_path):
    """A13B as published: one tensor per expert projection (transformers saves them stacked)."""
    name, directory, reference = variant
    if name != "hunyuan-moe":
        pytest.skip("a mixture-of-experts checkpoint's")
    published = tmp_path / "published"
    save_per_expert(directory, published)
    names = load_file(published / "model.safetensors").keys()
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names and "model.layers.0.mlp.gate.wg.weight" in names
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(make_engine(published).prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)


def test_a_compressed_copy_gives_the_logits_of_its_original(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["hunyuan-biases"])
    check_compressed_copy(original, compressed, weight_modes=("compressed_in_memory",))


parallel_engines = parallel_engines_fixture("hunyuan-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_parallel_logits_match_transformers(parallel_engines):
    # 4 heads and 2 KV heads over 2 ranks: each rank its heads' q/k/v rows and bias rows, the per-head norms whole;
    # o_proj's bias added once
    assert_prompt_logits(parallel_engines, "hunyuan-biases", (2, 1), (1, 1))
    # A13B at tp=2 + ep=2: each rank 2 of the 4 experts, the router and shared MLP's halves
    assert_prompt_logits(parallel_engines, "hunyuan-moe", (2, 1, 2), (1, 1, 1))


def _raw(**changes) -> dict:
    config = transformers.HunYuanDenseV1Config(**HUNYUAN).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"attention_bias": "true"}, CheckpointError, "attention_bias must be true or false, got 'true'"),
    ({"head_dim": 0}, CheckpointError, "head_dim must be a positive integer, got 0"),
    ({"rope_scaling": {"type": "dynamic", "alpha": -2.0}, "rope_parameters": None}, CheckpointError,
     "rope_scaling: alpha must be a positive number, got -2.0"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 300.0, "alpha": "1000"}}, CheckpointError,
     "rope_parameters: alpha must be a positive number, got '1000'"),
    ({"rope_parameters": {"rope_type": "su", "rope_theta": 300.0}}, UnsupportedModelError,
     "rope type 'su' is not supported for hunyuan_v1_dense"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


@pytest.mark.parametrize("changes, message", [
    ({"moe_topk": 5}, r"moe_topk must be a number of experts in \[1, 4\] \(num_experts\).*got 5"),
    ({"moe_topk": [2, 1]}, r"moe_topk must be .*one such number per layer, all equal; got \[2, 1\]"),
    ({"moe_topk": "2"}, "moe_topk must be .*got '2'"),
    ({"num_experts": 0}, "num_experts must be a positive integer, got 0"),
])
def test_expert_settings_the_engine_cannot_follow_are_refused_naming_the_field(changes, message):
    config = {**transformers.HunYuanMoEV1Config(**HUNYUAN, num_experts=4, moe_topk=2).to_dict(), **changes}
    with pytest.raises(CheckpointError, match=message):
        parse_config(config, Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    raw = {"model_type": "hunyuan_v1_dense", "head_dim": 16}
    cfg = parse_config(raw, Path("config.json"))
    their = transformers.HunYuanDenseV1Config(head_dim=16)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads) == (
        their.vocab_size, their.hidden_size, their.intermediate_size, their.num_hidden_layers,
        their.num_attention_heads)
    # num_key_value_heads omitted: one per query head
    assert cfg.num_kv_heads == their.num_key_value_heads == 32
    assert (cfg.qkv_bias, cfg.o_bias, cfg.rope.theta, cfg.rope.rope_type) == (
        their.attention_bias, their.attention_bias, their.rope_parameters["rope_theta"],
        their.rope_parameters["rope_type"])
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings) == (their.rms_norm_eps, their.max_position_embeddings)
    assert (cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (
        their.tie_word_embeddings, their.bos_token_id, [their.eos_token_id])
    # head_dim omitted too: transformers' rotary takes hidden_size / num_attention_heads (its attention needs one)
    assert parse_config({"model_type": "hunyuan_v1_dense"}, Path("config.json")).head_dim == 128
    # A13B's: one expert, top-1, beside the shared MLP, each intermediate_size wide
    moe = parse_config({**raw, "model_type": "hunyuan_v1_moe"}, Path("config.json")).moe
    their = transformers.HunYuanMoEV1Config(head_dim=16)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size, moe.num_shared_experts) == (
        their.num_experts, their.moe_topk, their.intermediate_size, 1)
    assert all(moe.sparse_layers) and len(moe.sparse_layers) == their.num_hidden_layers
