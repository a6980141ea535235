"""K-EXAONE checkpoints (`exaone_moe`: K-EXAONE-236B-A23B): the engine computes what transformers computes on the same
random-weight checkpoint, read from the same config.json.

K-EXAONE is EXAONE 4.0's attention (q and k RMS-normed over each head; its sliding-window layers rotate, its global
layers do not) in Llama's layer: the attention's and the MLP's inputs are normed, their outputs not (EXAONE 4.0 norms
the outputs). Its MLPs are dense or sparse by mlp_layer_types (without it: the first first_k_dense_replace dense), the
sparse ones DeepSeek-V3's experts: sigmoid scores plus a correction bias (stored beside the router) choosing among the
best groups, weighted by those scores renormalized and scaled, beside num_shared_experts shared experts. One variant
is the published config shrunk (its head_dim wider than hidden_size / num_attention_heads, as published); prompts are
chunked and batched beside decode rows, on the C decode loop and on the torch path, and also run at tp=2 + ep=2, from
a compressed copy, and with a multi-token-prediction block stored beside the decoder (left unread, as transformers
leaves it).
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
LLLG = ["sliding_attention"] * 3 + ["full_attention"]
# K-EXAONE's config.json as TensorRT-LLM's tests quote it (num_hidden_layers cut to 4 there), shrunk, every other key
# kept: 4 heads of 32 over a hidden size of 64 (published: 64 heads of 128 over 6144), 2 KV heads, 8 experts of 32,
# top-2; weights 5x the default scale so that the attention moves the logits
PUBLISHED = {"bos_token_id": 1, "eos_token_id": 2, "head_dim": 32, "hidden_size": 64, "intermediate_size": 128,
             "layer_types": LLLG, "max_position_embeddings": 512, "moe_intermediate_size": 32, "n_group": 1,
             "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
             "num_hidden_layers": 4, "num_key_value_heads": 2, "num_shared_experts": 1, "pad_token_id": 0,
             "rms_norm_eps": 1e-05, "rope_theta": 1000000, "routed_scaling_factor": 2.5, "sliding_window": WINDOW,
             "tie_word_embeddings": False, "topk_group": 1, "vocab_size": 320, "initializer_range": 0.1}
# ... and its keys transformers does not read
UNREAD_KEYS = {"sliding_window_pattern": "LLLG", "scoring_func": "sigmoid", "topk_method": "noaux_tc",
               "first_last_k_dense_replace": 1, "is_moe_layer": [False, True, True, True]}


def _exaone_moe(**kw):
    return transformers.ExaoneMoeForCausalLM(transformers.ExaoneMoeConfig(**{**PUBLISHED, **kw}))


VARIANTS = {
    # K-EXAONE's shape, small: layer 0 dense (first_k_dense_replace 1), layers 0-2 sliding and rotating, layer 3 global
    # and NoPE, one group, renormalized top-2 scaled by 2.5, one shared expert
    "k-exaone": (_exaone_moe, UNREAD_KEYS),
    # a small rope base (rotating a global layer would show), layer 1 dense by mlp_layer_types, 4 groups of which 2 a
    # token, unrenormalized unscaled weights, two shared experts
    "exaone-moe-groups": (lambda: _exaone_moe(rope_theta=200.0, mlp_layer_types=["sparse", "dense", "sparse", "sparse"],
                                              n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.0,
                                              num_shared_experts=2), {}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "exaone-moe-groups",
                      "the decode paths differ in attention only, which one variant covers with its windows")


def test_config_is_what_transformers_reads(variant):
    """Input norms (no output norms), per-head q/k norms, windows and NoPE layers, dense and sparse layers and grouped
    routing as transformers builds them, and memory sizing counting every parameter (the routing biases included)."""
    name, directory, reference = variant
    cfg, their = load_config(directory), reference.config
    layers = reference.model.layers
    assert (cfg.input_norms, cfg.sandwich_norms, cfg.qk_norm, cfg.head_dim) == (True, False, True, their.head_dim)
    assert cfg.sliding_windows == [WINDOW if layer.self_attn.is_sliding else None for layer in layers]
    assert cfg.nope_layers == [not layer.self_attn.is_sliding for layer in layers] == [False] * 3 + [True]
    moe = cfg.moe
    assert moe.sparse_layers == [hasattr(layer.mlp, "experts") for layer in layers]
    assert (moe.num_groups, moe.topk_groups, moe.num_experts_per_tok, moe.norm_topk_prob, moe.routed_scaling_factor,
            moe.num_shared_experts, moe.scoring) == (their.n_group, their.topk_group, their.num_experts_per_tok,
                                                     their.norm_topk_prob, their.routed_scaling_factor,
                                                     their.num_shared_experts, "sigmoid")
    bias = sum(b.numel() for n, b in reference.named_buffers() if n.endswith("e_score_correction_bias"))
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters()) + bias


def test_the_published_tensor_names_and_a_multi_token_prediction_block_load(variant, tmp_path):
    """The correction bias beside the router (as published and as transformers saves it) or under it (as transformers
    names it in memory), and an MTP block (mtp.*) left unread, as transformers leaves it."""
    name, directory, reference = variant
    if name != "k-exaone":
        pytest.skip("the same for every variant")
    tensors = load_file(directory / "model.safetensors")
    assert {"model.layers.1.mlp.e_score_correction_bias", "model.layers.1.mlp.experts.7.down_proj.weight",
            "model.layers.1.mlp.shared_experts.up_proj.weight"} <= tensors.keys()
    bias = tensors.pop("model.layers.1.mlp.e_score_correction_bias")
    tensors["model.layers.1.mlp.gate.e_score_correction_bias"] = bias
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.ones(64)
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(make_engine(tmp_path).prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)


def test_a_compressed_copy_gives_the_logits_of_its_original(tmp_path):
    # compressed_in_memory streams the dense layer's MLP and expands the experts of the MoE layers
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["k-exaone"])
    check_compressed_copy(original, compressed, weight_modes=("compressed_in_memory",))


parallel_engines = parallel_engines_fixture("exaone-moe-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_and_expert_parallel_logits_match_transformers(parallel_engines):
    # tp=2 + ep=2: each rank 2 of the 4 query heads and 1 of the 2 KV heads (each head normed alone), half the dense
    # MLP and of the routed experts, the router and the shared experts whole; sliding, NoPE and rotating layers
    assert_prompt_logits(parallel_engines, "exaone-moe-groups", (2, 1, 2), (1, 1, 1))


def _raw(**changes) -> dict:
    config = transformers.ExaoneMoeConfig(**PUBLISHED).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"scoring_func": "softmax"}, UnsupportedModelError, "scoring_func 'softmax' is not supported"),
    ({"topk_method": "greedy"}, UnsupportedModelError, "topk_method 'greedy' is not supported"),
    ({"layer_types": None, "sliding_window_pattern": "LLLG"}, CheckpointError,
     "sliding_window_pattern must be a positive integer .* when layer_types is not given, got 'LLLG'"),
    ({"layer_types": ["sliding_attention"] * 3}, CheckpointError, "layer_types must list one of"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, CheckpointError, "mlp_layer_types must list one of"),
    ({"num_shared_experts": -1}, CheckpointError, "num_shared_experts must be a non-negative integer, got -1"),
    ({"num_experts": 0}, CheckpointError, "num_experts must be a positive integer, got 0"),
    ({"n_group": 3}, CheckpointError, "n_group 3 must split the 8 routed experts into equal groups"),
    ({"sliding_window": 0}, CheckpointError, "sliding_window must be a positive integer, got 0"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    cfg, their = parse_config({"model_type": "exaone_moe"}, Path("config.json")), transformers.ExaoneMoeConfig()
    assert_shape_as_transformers(cfg, their, 128)
    assert (cfg.rope.theta, cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.tie_word_embeddings, cfg.bos_token_id,
            cfg.eos_token_ids) == (their.rope_parameters["rope_theta"], their.rms_norm_eps,
                                   their.max_position_embeddings, False, their.bos_token_id, [their.eos_token_id])
    assert cfg.sliding_windows == [their.sliding_window if kind == "sliding_attention" else None
                                   for kind in their.layer_types]
    assert cfg.nope_layers == [kind == "full_attention" for kind in their.layer_types]
    moe = cfg.moe
    assert moe.sparse_layers == [kind == "sparse" for kind in their.mlp_layer_types]
    assert (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size, moe.num_shared_experts, moe.num_groups,
            moe.topk_groups, moe.norm_topk_prob, moe.routed_scaling_factor) == (
        their.num_experts, their.num_experts_per_tok, their.moe_intermediate_size, their.num_shared_experts,
        their.n_group, their.topk_group, their.norm_topk_prob, their.routed_scaling_factor)
