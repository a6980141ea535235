"""MiniMax-M2 and M2.1 checkpoints (`minimax_m2`): the engine computes what transformers computes on the same
random-weight checkpoint, read from the same config.json.

MiniMax-M2's decoder norms q and k each with one RMSNorm over the whole projection (all heads together, before they
are split; under tensor parallelism the ranks' sums of squares all-reduced), rotates only each head's first rotary_dim
dims, and makes every layer a mixture of experts: the top-k of the router's sigmoid scores plus a correction bias
(stored beside the router, block_sparse_moe.e_score_correction_bias), weighted by their scores renormalized; its
experts stored one tensor per projection (w1, w3, w2). Its published configs spell the rope as rope_theta and
rotary_dim at the top level and carry keys transformers does not read (scoring_func, use_qk_norm, ...), and a count of
multi-token-prediction modules, stored after the decoder's layers and left unread. Prompts are chunked and batched
beside decode rows on the C decode loop and on the torch path, at tp=2 + ep=2, and from a compressed copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import load_config, parse_config
from engine.errors import CheckpointError, UnsupportedModelError
from engine.moe import route_grouped
from tests.engine.conftest import SMALL, save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, check_compressed_copy, check_decode_path,
                                        parallel_engines_fixture, variant_fixture)
from tests.engine.test_mechanics import make_engine
from tests.engine.test_parallel import PROMPT, assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# Heads 24 wide (hidden_size / num_attention_heads is 16), half of each rotated; 8 experts, 2 per token; weights 5x
# the default scale so that the attention moves the logits; token ids inside the small vocabulary
MINIMAX_M2 = {**SMALL, "head_dim": 24, "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
              "initializer_range": 0.1, "rope_parameters": {"rope_type": "default", "rope_theta": 300.0},
              "rotary_dim": 12, "bos_token_id": 1, "eos_token_id": 2}
# The published configs' spelling: rope_theta and rotary_dim at the top level, the keys transformers does not read
PUBLISHED_SPELLING = {"rope_parameters": None, "rope_theta": 300.0, "rotary_dim": 12, "scoring_func": "sigmoid",
                      "use_routing_bias": True, "use_qk_norm": True, "qk_norm_type": "per_layer",
                      "shared_intermediate_size": 0, "attn_type_list": [1, 1], "use_mtp": True, "num_mtp_modules": 3,
                      "mtp_transformer_layers": 1, "sliding_window": None}


def _minimax_m2(**kw):
    return transformers.MiniMaxM2ForCausalLM(transformers.MiniMaxM2Config(**{**MINIMAX_M2, **kw}))


VARIANTS = {"minimax-m2": (lambda: _minimax_m2(), PUBLISHED_SPELLING)}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "minimax-m2", "one variant")


def test_the_prediction_modules_are_left_unread_and_each_feature_moves_the_logits(variant, tmp_path, monkeypatch):
    """The multi-token-prediction modules (num_mtp_modules layers after the decoder's) load unread; without the
    correction bias, or with per-head q/k norms, the logits move far beyond the tolerance."""
    name, directory, reference = variant
    published = tmp_path / "published"
    published.mkdir()
    tensors = load_file(directory / "model.safetensors")
    for layer in (2, 3, 4):
        for part in ("self_attn.q_proj.weight", "block_sparse_moe.gate.weight", "enorm.weight"):
            tensors[f"model.layers.{layer}.{part}"] = torch.randn(8, 64)
    save_file(tensors, str(published / "model.safetensors"), metadata={"format": "pt"})
    (published / "config.json").write_text((directory / "config.json").read_text())
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    engine = make_engine(published)
    torch.testing.assert_close(engine.prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)
    for layer in engine.model.weights.layers:   # the choice by score alone
        monkeypatch.setattr(layer.moe, "correction_bias", None)
    assert (engine.prompt_logits(PROMPT) - theirs).abs().max() > 0.1
    monkeypatch.undo()
    monkeypatch.setattr(engine.model.config, "qk_norm_over_heads", False)   # each head normed alone, by the
    for layer in engine.model.weights.layers:                                # first head's weights
        monkeypatch.setattr(layer, "q_norm", layer.q_norm[:24])
        monkeypatch.setattr(layer, "k_norm", layer.k_norm[:24])
    assert (engine.prompt_logits(PROMPT) - theirs).abs().max() > 0.1


def test_routing_in_bfloat16_is_what_transformers_computes():
    """The router multiplies in the model's dtype (its logits rounded to bfloat16 before the sigmoid), the top-k by
    score plus correction bias, their scores renormalized: the same experts and the same weights, bit for bit."""
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

    config = transformers.MiniMaxM2Config(**MINIMAX_M2)
    cfg = parse_config(config.to_dict(), Path("config.json")).moe
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=generator).to(torch.bfloat16)
    weight = (0.5 * torch.randn(8, 64, generator=generator)).to(torch.bfloat16)
    bias = 0.1 * torch.randn(8, generator=generator)
    router = MiniMaxM2TopKRouter(config).to(torch.bfloat16)
    with torch.no_grad():
        router.weight.copy_(weight)
        _, their_weights, their_ids = router(x, bias)
    weights, ids = route_grouped(x, weight, bias, cfg)
    order, their_order = ids.argsort(-1), their_ids.argsort(-1)   # transformers' top-k is unsorted
    assert torch.equal(ids.gather(1, order), their_ids.gather(1, their_order))
    assert torch.equal(weights.gather(1, order), their_weights.gather(1, their_order))


def test_a_compressed_copy_gives_the_logits_of_its_original(tmp_path):
    # every layer a mixture of experts, whose experts are expanded at load: decompress_on_load alone
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["minimax-m2"])
    check_compressed_copy(original, compressed, weight_modes=("decompress_on_load",))


parallel_engines = parallel_engines_fixture("minimax-m2-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_and_expert_parallel_logits_match_transformers(parallel_engines):
    # tp=2 + ep=2: each rank 2 of the 4 query heads and 1 of the 2 KV heads, their q/k norm rows, the sums of squares
    # all-reduced; half the experts; the router and its correction bias whole on each
    assert_prompt_logits(parallel_engines, "minimax-m2", (2, 1, 2), (1, 1, 1))


def _raw(**changes) -> dict:
    config = transformers.MiniMaxM2Config(**MINIMAX_M2).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"scoring_func": "softmax"}, UnsupportedModelError, 'scoring_func "softmax" is not supported for minimax_m2'),
    ({"use_routing_bias": False}, UnsupportedModelError, "use_routing_bias false is not supported"),
    ({"use_qk_norm": False}, UnsupportedModelError, "use_qk_norm false is not supported"),
    ({"qk_norm_type": "per_head"}, UnsupportedModelError, 'qk_norm_type "per_head" is not supported'),
    ({"shared_intermediate_size": 512}, UnsupportedModelError, "shared_intermediate_size 512 is not supported"),
    ({"attn_type_list": [0, 1]}, UnsupportedModelError, "attn_type_list must mark every layer 1"),
    ({"rope_parameters": None, "rotary_dim": 13}, CheckpointError, "rotary_dim must be an even number"),
    ({"rope_parameters": None, "rotary_dim": 48}, CheckpointError, "rotary_dim must be an even number"),
    ({"num_experts_per_tok": 9}, CheckpointError, "num_experts_per_tok 9 exceeds the 8 experts"),
    ({"num_local_experts": "8"}, CheckpointError, "num_local_experts must be a positive integer, got '8'"),
    ({"num_mtp_modules": -1}, CheckpointError, "num_mtp_modules must be a non-negative integer, got -1"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_config_and_omitted_fields_are_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg, their = load_config(directory), reference.config
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope.theta, cfg.num_nextn_layers) == (
        their.head_dim, int(their.head_dim * their.rope_parameters["partial_rotary_factor"]),
        their.rope_parameters["rope_theta"], 3) == (24, 12, 300.0, 3)
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters()) + 2 * 8   # + the bias buffers
    raw = {"model_type": "minimax_m2", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 32,
           "num_hidden_layers": 2, "num_attention_heads": 16}
    cfg = parse_config(raw, Path("config.json"))
    their = transformers.MiniMaxM2Config(**{key: value for key, value in raw.items() if key != "model_type"})
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rotary_dim, cfg.rope.theta, cfg.rms_norm_eps) == (
        their.head_dim, their.num_key_value_heads, None, their.rope_parameters["rope_theta"], their.rms_norm_eps)
    assert (cfg.max_position_embeddings, cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (
        their.max_position_embeddings, their.tie_word_embeddings, their.bos_token_id, [their.eos_token_id])
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.intermediate_size) == (
        their.num_local_experts, their.num_experts_per_tok, their.intermediate_size) == (256, 8, 32)
    # num_experts: transformers' other name for num_local_experts; a rope's partial_rotary_factor wins over rotary_dim
    cfg = parse_config({**raw, "num_experts": 16, "rotary_dim": 64,
                        "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}}, Path("c.json"))
    their = transformers.MiniMaxM2Config(num_experts=16, rotary_dim=64, head_dim=128,
                                         rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25})
    their_rotary_dim = int(128 * their.rope_parameters["partial_rotary_factor"])
    assert (cfg.moe.num_experts, cfg.rotary_dim) == (their.num_local_experts, their_rotary_dim) == (16, 32)
