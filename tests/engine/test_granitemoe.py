"""Granite 3.x MoE checkpoints (`granitemoe`: granite-3.1-1b-a400m, -3b-a800m; `granitemoeshared`: the same with a
shared MLP): the engine computes what transformers computes on the same random-weight checkpoint, read from the same
config.json.

Granite's multipliers (the embeddings', the softmax's scale, each block's output before its residual add, the logits'
divisor) around Llama's attention, every MLP a mixture of experts stored stacked as input_linear (gate and up rows of
each expert) and output_linear, routed by the top-k of the router's logits weighted by a softmax over those k alone;
granitemoeshared adds beside them a shared MLP of its own width (shared_intermediate_size), its gate and up fused too,
its output added unweighted. The first variant is granite-3.1-1b-a400m's published config.json (as a public benchmark
preset in the code index copies it) shrunk, every other key kept. Prompts are chunked and batched beside decode rows,
on the C decode loop and on the torch path, at tp=2 + ep=2, and from a compressed copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import load_config, parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from engine.moe import route
from tests.engine.conftest import SMALL, save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, check_compressed_copy, check_decode_path,
                                        parallel_engines_fixture, variant_fixture)
from tests.engine.test_parallel import PROMPT, assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# granite-3.1-1b-a400m's config.json, shrunk (hidden 1024, 24 layers, 16 heads, 8 KV heads, 32 experts of 512, top-8,
# vocab 49152 in the original); its token ids kept
GRANITE_3_1_1B_A400M = {
    "architectures": ["GraniteMoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.1,
    "attention_multiplier": 0.015625, "bos_token_id": 0, "embedding_multiplier": 12.0, "eos_token_id": 0,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 32, "logits_scaling": 6.0,
    "max_position_embeddings": 131072, "model_type": "granitemoe", "num_attention_heads": 4, "num_experts_per_tok": 2,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 4, "output_router_logits": False,
    "pad_token_id": 0, "residual_multiplier": 0.22, "rms_norm_eps": 1e-6, "rope_scaling": None,
    "rope_theta": 1_500_000.0, "router_aux_loss_coef": 0.001, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": False, "vocab_size": 320}
# Multipliers far from 1 and an attention scale of its own, experts 32 wide, the shared MLP 48 wide
GRANITE = {**SMALL, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
           "initializer_range": 0.1, "embedding_multiplier": 3.0, "attention_multiplier": 0.5,
           "residual_multiplier": 0.5, "logits_scaling": 4.0, "eos_token_id": 2}


def _published():
    return transformers.GraniteMoeForCausalLM(transformers.GraniteMoeConfig.from_dict(GRANITE_3_1_1B_A400M))


def _shared(**kw):
    return transformers.GraniteMoeSharedForCausalLM(transformers.GraniteMoeSharedConfig(**{**GRANITE, **kw}))


VARIANTS = {
    # granite-3.1-1b-a400m's config, shrunk, spelled as published (top-level rope_theta, tied embeddings)
    "granite-3.1-1b-a400m": (_published, {"rope_theta": GRANITE_3_1_1B_A400M["rope_theta"], "rope_scaling": None}),
    # the shared MLP beside the experts, every attention projection biased, untied
    "granitemoeshared": (lambda: _shared(shared_intermediate_size=48, attention_bias=True), {}),
    # granitemoeshared without a shared MLP (shared_intermediate_size 0, transformers' default), top-1
    "granitemoeshared-none": (lambda: _shared(shared_intermediate_size=0, num_experts_per_tok=1), {}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "granitemoeshared",
                      "the decode paths differ in attention only, which one variant covers")


def test_config_is_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg, their = load_config(directory), reference.config
    assert (cfg.embedding_multiplier, cfg.attention_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == (
        their.embedding_multiplier, their.attention_multiplier, their.residual_multiplier, their.logits_scaling)
    assert all(cfg.moe.sparse_layers)
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.norm_topk_prob) == (
        their.num_local_experts, their.num_experts_per_tok, True)
    assert cfg.moe.shared_width == getattr(their, "shared_intermediate_size", 0)
    attention = reference.model.layers[0].self_attn
    assert (cfg.qkv_bias, cfg.o_bias) == (attention.q_proj.bias is not None, attention.o_proj.bias is not None)
    assert (cfg.tie_word_embeddings, cfg.rope.theta) == (their.tie_word_embeddings, their.rope_parameters["rope_theta"])
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())


def test_the_published_tensor_names_load(variant):
    # transformers saves the experts under the names Granite MoE is published with
    name, directory, _ = variant
    names = load_file(directory / "model.safetensors").keys()
    block = "model.layers.1.block_sparse_moe."
    assert {block + "input_linear.weight", block + "output_linear.weight", block + "router.layer.weight"} <= names
    assert ("model.layers.1.shared_mlp.input_linear.weight" in names) == (name == "granitemoeshared")


@pytest.fixture(scope="module")
def shared_engine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("granitemoe-features")
    reference = save_random_checkpoint(directory, *VARIANTS["granitemoeshared"])
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    return LLMEngine(directory, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, block_size=8)), theirs


@pytest.mark.parametrize("change", ["softmax over all experts", "embedding_multiplier", "attention_multiplier",
                                    "residual_multiplier", "logits_scaling", "no shared MLP"])
def test_what_sets_granite_moe_apart_moves_the_logits_far_from_transformers(shared_engine, change, monkeypatch):
    # the logits check is sharp: weighted by the softmax over all experts (not renormalized over the top-k), or
    # without any one multiplier or the shared MLP, the same weights are far from transformers' logits
    engine, theirs = shared_engine
    model, cfg = engine.model, engine.model.config
    torch.testing.assert_close(engine.prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)
    if change == "softmax over all experts":
        for layer in model.weights.layers:
            monkeypatch.setattr(layer.moe, "normalize", False)
    elif change == "no shared MLP":
        for layer in model.weights.layers:
            monkeypatch.setattr(layer.moe, "shared_gate_up", None)
    elif change == "embedding_multiplier":
        monkeypatch.setattr(model, "embedding_multiplier", 1.0)
    elif change == "attention_multiplier":
        monkeypatch.setattr(model, "scale", cfg.head_dim ** -0.5)
    else:
        monkeypatch.setattr(cfg, change, 1.0)
    assert (engine.prompt_logits(PROMPT) - theirs).abs().max() > 0.01   # 100 times the check's tolerance


def test_a_softmax_over_the_top_k_logits_is_the_renormalized_top_k_of_the_softmax():
    # why Granite MoE routes as Mixtral does: a softmax's top-k renormalized is the softmax of the top-k logits
    torch.manual_seed(0)
    x, router = torch.randn(9, 16), torch.randn(4, 16)
    top, ids = torch.topk(x @ router.T, 2, dim=-1)
    weights, chosen = route(x, router, 2, normalize=True)
    assert torch.equal(chosen, ids)
    torch.testing.assert_close(weights, torch.softmax(top, dim=-1))


def test_a_compressed_copy_gives_the_logits_of_its_original(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["granitemoeshared"])
    check_compressed_copy(original, compressed, weight_modes=("compressed_in_memory",))


parallel_engines = parallel_engines_fixture("granitemoe-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_and_expert_parallel_logits_match_transformers(parallel_engines):
    # tp=2 + ep=2: each rank 2 of the 4 experts and half the heads with their bias rows; the router and the shared
    # MLP whole on each
    assert_prompt_logits(parallel_engines, "granitemoeshared", (2, 1, 2), (1, 1, 1))


def _raw(model_type: str = "granitemoe", **changes) -> dict:
    config_type = transformers.GraniteMoeSharedConfig if model_type == "granitemoeshared" else \
        transformers.GraniteMoeConfig
    return {**config_type(**GRANITE).to_dict(), **changes}


@pytest.mark.parametrize("model_type, changes, error, message", [
    ("granitemoe", {"num_experts_per_tok": 5}, CheckpointError, "num_experts_per_tok 5 exceeds the 4 experts"),
    ("granitemoe", {"num_local_experts": 0}, CheckpointError, "num_local_experts must be a positive integer, got 0"),
    ("granitemoe", {"embedding_multiplier": 0}, CheckpointError, "embedding_multiplier must be a positive number"),
    ("granitemoe", {"attention_multiplier": "1"}, CheckpointError, "attention_multiplier must be a positive number"),
    ("granitemoe", {"attention_bias": 1}, CheckpointError, "attention_bias must be true or false, got 1"),
    ("granitemoe", {"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
    ("granitemoeshared", {"shared_intermediate_size": -1}, CheckpointError,
     "shared_intermediate_size must be a non-negative integer .*, got -1"),
    ("granitemoeshared", {"shared_intermediate_size": 1.5}, CheckpointError,
     "shared_intermediate_size must be a non-negative integer"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(model_type, changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(model_type, **changes), Path("config.json"))


@pytest.mark.parametrize("model_type, config_type", [("granitemoe", "GraniteMoeConfig"),
                                                     ("granitemoeshared", "GraniteMoeSharedConfig")])
def test_omitted_fields_default_as_transformers_defaults_them(model_type, config_type):
    cfg, their = parse_config({"model_type": model_type}, Path("config.json")), getattr(transformers, config_type)()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads) == (their.vocab_size, their.hidden_size, their.intermediate_size,
                                  their.num_hidden_layers, their.num_attention_heads, their.num_key_value_heads)
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        their.rope_parameters["rope_theta"], their.rope_parameters["rope_type"], their.rms_norm_eps,
        their.max_position_embeddings)
    assert (cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (
        their.tie_word_embeddings, their.bos_token_id, [their.eos_token_id])
    assert (cfg.embedding_multiplier, cfg.attention_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == (
        their.embedding_multiplier, their.attention_multiplier, their.residual_multiplier, their.logits_scaling)
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.intermediate_size, cfg.moe.shared_width) == (
        their.num_local_experts, their.num_experts_per_tok, their.intermediate_size,
        getattr(their, "shared_intermediate_size", 0))
    assert (cfg.qkv_bias, cfg.o_bias) == (their.attention_bias, their.attention_bias)
