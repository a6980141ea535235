"""Arcee Trinity checkpoints (`afmoe`: Trinity-Nano, -Mini, -Large): the engine computes what transformers computes on
the same random-weight checkpoint, read from the same config.json.

Trinity gates its attention: the attention's output, each element of each head, is multiplied by the sigmoid of
gate_proj of the layer's input before o_proj (the gate rows fused after q, k and v's, sharded with the query heads
under TP). Its q and k are RMS-normed over each head; its sliding-window layers (layer_types, or without it all but
every global_attn_every_n_layers-th) rotate, its full-attention ones do not. Four norms a layer (the attention's and
the MLP's inputs and outputs, weights multiplying the float32 row); with mup_enabled the embeddings are multiplied by
sqrt(hidden_size). The first num_dense_layers MLPs are dense, the others experts: the top-k of the router's sigmoid
scores plus expert_bias (steering the choice only), weighted by those scores renormalized times route_scale, beside
num_shared_experts shared experts as one MLP. One variant is the published config shrunk; prompts are chunked and
batched beside decode rows, on the C decode loop and on the torch path, and also run at tp=2 + ep=2 and from a
compressed copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import load_config, parse_config
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, assert_shape_as_transformers, check_compressed_copy,
                                        check_decode_path, parallel_engines_fixture, variant_fixture)
from tests.engine.test_mechanics import make_engine
from tests.engine.test_parallel import PROMPT, assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 6   # shorter than all prompts but the first, and not a multiple of the 8-token blocks
# Trinity-Nano-Preview's config.json as AWS's NxDI Trinity port quotes it in its unit tests, shrunk, every other key
# kept (its auto_map and dtype left out): 4 heads of 32 over a hidden size of 64 (published: 8 of 128 over 1024;
# Trinity-Mini's 32 of 128 over 2048, wider than hidden_size / num_attention_heads as here), 2 KV heads, 4 layers of
# which the first 2 dense (published: 56, 2), 8 experts of 32, top-2 (published: 128 of 256, top-8); weights 5x the
# default scale so that the attention moves the logits
PUBLISHED = {"architectures": ["AfmoeForCausalLM"], "attention_dropout": 0.0, "global_attn_every_n_layers": 4,
             "head_dim": 32, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.1,
             "intermediate_size": 128, "max_position_embeddings": 512, "model_type": "afmoe",
             "moe_intermediate_size": 32, "mup_enabled": True, "num_attention_heads": 4, "num_dense_layers": 2,
             "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_key_value_heads": 2,
             "num_shared_experts": 1, "rms_norm_eps": 1e-05, "rope_theta": 10000, "route_scale": 2.826,
             "sliding_window": WINDOW, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 320}
# ... and its keys transformers does not read (the variant it computes)
UNREAD_KEYS = {"n_group": 1, "num_expert_groups": 1, "num_limited_groups": 1, "route_norm": True,
               "score_func": "sigmoid", "topk_group": 1, "use_grouped_mm": True}
# its config.json as published: those keys, its rope as rope_theta and rope_scaling, and no layer_types (transformers
# derives them from global_attn_every_n_layers)
AS_PUBLISHED = {**UNREAD_KEYS, "rope_scaling": None, "rope_theta": 10000, "layer_types": None}
FULL_FIRST = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]


def _afmoe(**kw):
    config = {key: value for key, value in {**PUBLISHED, **kw}.items() if key not in ("architectures", "model_type")}
    return transformers.AfmoeForCausalLM(transformers.AfmoeConfig(**config))


VARIANTS = {
    # Trinity-Nano's shape, small: layers 0-2 sliding and rotating, layer 3 full and NoPE, layers 0-1 dense, muP
    # embeddings, the renormalized top-2 times 2.826, one shared expert
    "trinity-nano": (_afmoe, AS_PUBLISHED),
    # layer_types given (a full-attention layer first), a small rope base (rotating a full layer would show), one dense
    # layer, two shared experts, unscaled weights, no muP, q/k/v/o biased (the gate never is)
    "afmoe-layer-types": (lambda: _afmoe(layer_types=FULL_FIRST, rope_theta=200.0, num_dense_layers=1,
                                         num_shared_experts=2, route_scale=1.0, mup_enabled=False,
                                         attention_bias=True), {}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "afmoe-layer-types",
                      "the decode paths differ in attention only, which one variant covers with its gate and windows")


def test_config_is_what_transformers_reads(variant):
    """The gate, four norms, per-head q/k norms, windows and NoPE layers, dense and sparse layers, the routing and the
    muP multiplier as transformers builds them, and memory sizing counting every parameter (the gates included)."""
    name, directory, reference = variant
    cfg, their = load_config(directory), reference.config
    layers = reference.model.layers
    assert (cfg.attn_output_gate, cfg.sandwich_norms, cfg.input_norms, cfg.qk_norm, cfg.head_dim) == (
        True, True, True, True, layers[0].self_attn.head_dim)
    assert (cfg.qkv_bias, cfg.o_bias) == (layers[0].self_attn.q_proj.bias is not None,) * 2
    assert cfg.sliding_windows == [layer.self_attn.sliding_window for layer in layers]
    assert cfg.nope_layers == [not layer.self_attn.is_local_attention for layer in layers]
    assert cfg.embedding_multiplier == (their.hidden_size ** 0.5 if their.mup_enabled else 1.0)
    moe = cfg.moe
    assert moe.sparse_layers == [layer.moe_enabled for layer in layers]
    assert (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size, moe.shared_width, moe.scoring,
            moe.norm_topk_prob, moe.routed_scaling_factor, moe.num_groups) == (
        their.num_experts, their.num_experts_per_tok, their.moe_intermediate_size,
        layers[-1].mlp.shared_experts.gate_proj.out_features, "sigmoid", True, their.route_scale, 1)
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())


def test_the_published_tensor_names_and_stacked_experts_load(variant, tmp_path):
    """The router under router.gate, expert_bias beside it and one tensor per expert projection (as published and as
    transformers saves them); the experts also stacked (experts.gate_up_proj, experts.down_proj: as transformers keeps
    them in memory)."""
    name, directory, reference = variant
    if name != "trinity-nano":
        pytest.skip("the same for every variant")
    tensors = load_file(directory / "model.safetensors")
    assert {"model.layers.2.mlp.router.gate.weight", "model.layers.2.mlp.expert_bias",
            "model.layers.2.mlp.experts.7.down_proj.weight", "model.layers.2.mlp.shared_experts.up_proj.weight",
            "model.layers.2.self_attn.gate_proj.weight", "model.layers.2.pre_mlp_layernorm.weight",
            "model.layers.2.post_mlp_layernorm.weight"} <= tensors.keys()
    for layer in (2, 3):
        p = f"model.layers.{layer}.mlp.experts."
        tensors[p + "gate_up_proj"] = torch.stack([torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"),
                                                              tensors.pop(f"{p}{e}.up_proj.weight")])
                                                   for e in range(8)])
        tensors[p + "down_proj"] = torch.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in range(8)])
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(make_engine(tmp_path).prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)


def test_a_compressed_copy_gives_the_logits_of_its_original(tmp_path):
    # compressed_in_memory streams the dense layers' MLPs and expands the experts of the MoE layers
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["trinity-nano"])
    check_compressed_copy(original, compressed)


parallel_engines = parallel_engines_fixture("afmoe-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_and_expert_parallel_logits_match_transformers(parallel_engines):
    # tp=2 + ep=2: each rank 2 of the 4 query heads with their gate rows and 1 of the 2 KV heads (each head normed
    # alone), half the dense MLP and of the routed experts, the router, expert_bias and the shared experts whole
    assert_prompt_logits(parallel_engines, "afmoe-layer-types", (2, 1, 2), (1, 1, 1))


def _raw(**changes) -> dict:
    config = {**PUBLISHED, **AS_PUBLISHED}
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"score_func": "softmax"}, UnsupportedModelError, 'score_func "softmax" is not supported for afmoe'),
    ({"route_norm": False}, UnsupportedModelError, "route_norm false is not supported for afmoe"),
    ({"n_group": 2}, UnsupportedModelError, "n_group 2 is not supported for afmoe"),
    ({"num_dense_layers": None}, CheckpointError, "num_dense_layers must be a non-negative integer, got None"),
    ({"num_shared_experts": -1}, CheckpointError, "num_shared_experts must be a non-negative integer, got -1"),
    ({"num_experts_per_tok": 9}, CheckpointError, "num_experts_per_tok 9 exceeds the 8 experts"),
    ({"route_scale": 0}, CheckpointError, "route_scale must be a positive number, got 0"),
    ({"global_attn_every_n_layers": 0}, CheckpointError, "global_attn_every_n_layers must be a positive integer"),
    ({"layer_types": ["sliding_attention"] * 3}, CheckpointError, "layer_types must list one of"),
    ({"sliding_window": None}, CheckpointError, "sliding_window is null but sliding_attention layers attend"),
    ({"mup_enabled": "yes"}, CheckpointError, "mup_enabled must be true or false"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    cfg, their = parse_config({"model_type": "afmoe"}, Path("config.json")), transformers.AfmoeConfig()
    assert_shape_as_transformers(cfg, their, their.head_dim)
    assert (cfg.rope.theta, cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.tie_word_embeddings, cfg.bos_token_id,
            cfg.eos_token_ids, cfg.qkv_bias, cfg.embedding_multiplier) == (
        their.rope_parameters["rope_theta"], their.rms_norm_eps, their.max_position_embeddings,
        their.tie_word_embeddings, None, [], their.attention_bias, 1.0)
    assert cfg.sliding_windows == [their.sliding_window if kind == "sliding_attention" else None
                                   for kind in their.layer_types]
    assert cfg.nope_layers == [kind == "full_attention" for kind in their.layer_types]
    moe = cfg.moe
    assert moe.sparse_layers == [i >= their.num_dense_layers for i in range(their.num_hidden_layers)]
    assert (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size, moe.num_shared_experts,
            moe.routed_scaling_factor) == (their.num_experts, their.num_experts_per_tok, their.moe_intermediate_size,
                                           their.num_shared_experts, their.route_scale)
