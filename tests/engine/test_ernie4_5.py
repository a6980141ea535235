"""ERNIE 4.5 checkpoints, dense (`ernie4_5`: ERNIE-4.5-0.3B) and mixture of experts (`ernie4_5_moe`:
ERNIE-4.5-21B-A3B, -300B-A47B): the engine computes what transformers computes on the same random-weight checkpoint,
read from the same config.json.

ERNIE's decoder is Llama's with an interleaved rotary (each pair (x0, x1), (x2, x3), ... rotated by its frequency),
which the loader turns into the engine's rotate-half by reordering q's and k's rows; use_bias puts a bias on every
projection; its embeddings are tied unless the config says otherwise. The mixture of experts makes every
moe_layer_interval-th layer from moe_layer_start_index to moe_layer_end_index sparse: a float32 softmax over the
experts, the top-k chosen by score plus a correction bias (stored as moe_statics, [1, experts]) that leaves their
weights alone, the chosen scores renormalized (their sum at least moe_norm_min), beside shared experts. Prompts are
chunked and batched beside decode rows, on the C decode loop and on the torch path, at tp=2 + ep=2, from a compressed
copy, and with the multi-token-prediction block the published checkpoints store (left unread, as transformers does).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import loader
from engine.compression.compress import compress_checkpoint
from engine.config import load_config, parse_config
from engine.errors import CheckpointError, UnsupportedModelError
from engine.moe import route_grouped
from tests.engine.conftest import SMALL
from tests.engine.family_checks import DECODE_PATHS, check_decode_path, parallel_engines_fixture, variant_fixture
from tests.engine.test_mechanics import make_engine
from tests.engine.test_parallel import PROMPT, assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

ROPE = {"rope_type": "default", "rope_theta": 300.0}
# Heads 24 wide (hidden_size / num_attention_heads is 16), weights 5x the default scale so that the attention moves
# the logits
ERNIE = {**SMALL, "head_dim": 24, "initializer_range": 0.1, "rope_parameters": ROPE}
# Layers 1 and 2 of 4 sparse (moe_layer_start_index, moe_layer_end_index): 8 experts, 2 per token, one shared expert
ERNIE_MOE = {**SMALL, "num_hidden_layers": 4, "initializer_range": 0.1, "rope_parameters": ROPE,
             "moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 32, "moe_num_shared_experts": 1,
             "moe_layer_start_index": 1, "moe_layer_end_index": 2}
# The published configs' spelling: rope_theta at the top level
PUBLISHED_SPELLING = {"rope_parameters": None, "rope_theta": 300.0}


def _ernie(**kw):
    return transformers.Ernie4_5ForCausalLM(transformers.Ernie4_5Config(**{**ERNIE, **kw}))


def _ernie_moe(**kw):
    return transformers.Ernie4_5_MoeForCausalLM(transformers.Ernie4_5_MoeConfig(**{**ERNIE_MOE, **kw}))


VARIANTS = {
    # ERNIE-4.5-0.3B's shape, small: GQA, tied embeddings, no biases
    "ernie4.5": (lambda: _ernie(), PUBLISHED_SPELLING),
    # every projection biased (their q and k rows reordered with the weights'), an untied head
    "ernie4.5-bias-untied": (lambda: _ernie(use_bias=True, tie_word_embeddings=False), {}),
    # ERNIE-4.5-21B-A3B's, small: a dense layer, two sparse ones, a dense one
    "ernie4.5-moe": (lambda: _ernie_moe(), PUBLISHED_SPELLING),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "ernie4.5-moe",
                      "the decode paths differ in attention only, which one variant covers")


def test_config_is_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg, their = load_config(directory), reference.config
    head_dim = getattr(their, "head_dim", their.hidden_size // their.num_attention_heads)   # as transformers does
    assert (cfg.head_dim, cfg.rope.theta, cfg.rms_norm_eps) == (head_dim, their.rope_parameters["rope_theta"],
                                                                 their.rms_norm_eps)
    assert cfg.rope_interleaved and cfg.tie_word_embeddings == their.tie_word_embeddings
    assert cfg.qkv_bias == cfg.o_bias == cfg.mlp_bias == their.use_bias
    if cfg.moe is not None:
        sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in reference.model.layers]
        assert cfg.moe.sparse_layers == sparse == [False, True, True, False]
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())


@pytest.mark.parametrize("layers, start, end, interval", [(6, 1, -1, 1), (6, 0, 3, 2), (6, 2, 4, 3), (3, 5, -1, 1)])
def test_sparse_layers_are_the_ones_transformers_builds(layers, start, end, interval):
    raw = transformers.Ernie4_5_MoeConfig(**{**ERNIE_MOE, "num_hidden_layers": layers, "moe_layer_start_index": start,
                                             "moe_layer_end_index": end, "moe_layer_interval": interval}).to_dict()
    model = transformers.Ernie4_5_MoeModel(transformers.Ernie4_5_MoeConfig(**raw))
    sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.layers]
    raw["moe_layer_end_index"] = end   # -1 as the published configs write it (transformers stores the last index)
    assert parse_config(raw, Path("config.json")).moe.sparse_layers == sparse


def test_routing_is_what_transformers_computes_also_when_the_chosen_scores_all_but_vanish():
    """A float32 softmax, the top-k by score plus correction bias, their scores renormalized; where the bias picks
    experts whose scores sum below moe_norm_min, the sum is taken as moe_norm_min (their weights stay tiny)."""
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

    config = transformers.Ernie4_5_MoeConfig(**ERNIE_MOE)
    cfg = parse_config(config.to_dict(), Path("config.json")).moe
    router = Ernie4_5_MoeTopKRouter(config)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=generator)
    cases = {"random": (torch.randn(8, 64, generator=generator), 0.1 * torch.randn(8, generator=generator)),
             # experts 0-5 score ~64 logits above 6 and 7, which the bias picks: their scores sum to ~1e-28
             "vanishing": (torch.cat([torch.ones(6, 64), torch.zeros(2, 64)]) + 0.01 * torch.randn(8, 64),
                           torch.tensor([0.0] * 6 + [10.0, 10.0]))}
    for name, (weight, bias) in cases.items():
        inputs = torch.ones(16, 64) + 0.1 * x if name == "vanishing" else x
        with torch.no_grad():
            router.weight.copy_(weight)
            router.moe_statics.e_score_correction_bias.copy_(bias[None])
            _, their_weights, their_ids = router(inputs)
        weights, ids = route_grouped(inputs, weight, bias, cfg)
        assert torch.equal(ids, their_ids), name
        torch.testing.assert_close(weights, their_weights, rtol=1e-6, atol=0, msg=name)
        if name == "vanishing":
            assert set(ids.flatten().tolist()) == {6, 7} and weights.sum(-1).max() < 1e-10


def test_each_distinguishing_feature_moves_the_logits_far_beyond_the_tolerance(variant, monkeypatch):
    name, directory, reference = variant
    if name != "ernie4.5-moe":
        pytest.skip("one checkpoint shows them")
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    engine = make_engine(directory)
    torch.testing.assert_close(engine.prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)
    sparse = [layer.moe for layer in engine.model.weights.layers if layer.moe is not None]
    for moe in sparse:   # the choice by score alone
        monkeypatch.setattr(moe, "correction_bias", None)
    assert (engine.prompt_logits(PROMPT) - theirs).abs().max() > 0.1
    engine.shutdown()
    monkeypatch.setattr(loader, "_rotary_halves", lambda rows, head_dim: rows)   # rotated as stored: by halves
    assert (make_engine(directory).prompt_logits(PROMPT) - theirs).abs().max() > 0.1


def test_model_info_reports_the_kv_bytes_of_its_heads(variant):
    """GetModelInfo's KV bytes per token: keys and values of head_dim (not hidden_size / num_attention_heads)."""
    from engine.demo import train_tokenizer
    from node_agent.models import _model_info

    name, directory, reference = variant
    if name != "ernie4.5":
        pytest.skip("the same for every variant")
    train_tokenizer(320).save(str(directory / "tokenizer.json"))
    their = reference.config
    per_token = their.num_hidden_layers * 2 * their.num_key_value_heads * their.head_dim
    assert _model_info("ernie", make_engine(directory)).kv_bytes_per_token == per_token * 4


def _published_copy(source: Path, directory: Path) -> None:
    """source's MoE checkpoint as another save may store it: each correction bias under the router
    (mlp.gate.moe_statics), and the multi-token-prediction block the published checkpoints carry."""
    directory.mkdir()
    tensors = {name.replace("mlp.moe_statics.", "mlp.gate.moe_statics."): tensor
               for name, tensor in load_file(source / "model.safetensors").items()}
    for name, shape in (("mtp_block.0.self_attn.q_proj.weight", (64, 64)), ("mtp_emb_norm.0.weight", (64,)),
                        ("mtp_hidden_norm.0.weight", (64,)), ("mtp_linear_proj.0.weight", (64, 128))):
        tensors["model." + name] = torch.randn(shape)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((source / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))


def test_the_published_tensor_names_load_and_the_prediction_block_is_left_unread(variant, tmp_path):
    name, directory, reference = variant
    if name != "ernie4.5-moe":
        pytest.skip("a mixture-of-experts checkpoint's")
    _published_copy(directory, tmp_path / "published")
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(make_engine(tmp_path / "published").prompt_logits(PROMPT), theirs,
                               rtol=1e-4, atol=1e-4)


def test_a_compressed_copy_keeps_the_float32_correction_bias_and_gives_the_original_logits(variant, tmp_path):
    """A bf16 checkpoint with its [1, experts] correction biases in float32, as published: the copy keeps them in
    float32 (rounded, they would rank other experts first), and its logits are the original's."""
    name, directory, reference = variant
    if name != "ernie4.5-moe":
        pytest.skip("a mixture-of-experts checkpoint's")
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    original.mkdir()
    (original / "config.json").write_text((directory / "config.json").read_text())
    tensors = load_file(directory / "model.safetensors")
    save_file({key: value if key.endswith("correction_bias") else value.to(torch.bfloat16)
               for key, value in tensors.items()}, str(original / "model.safetensors"), metadata={"format": "pt"})
    compress_checkpoint(original, compressed, chunk_size=64, show_progress=False, say=lambda *_: None)
    plain, engine = make_engine(original, dtype="float32"), make_engine(compressed, dtype="float32")
    assert torch.equal(engine.prompt_logits(PROMPT), plain.prompt_logits(PROMPT))
    for i, layer in enumerate(engine.model.weights.layers):
        if layer.moe is not None:
            stored = tensors[f"model.layers.{i}.mlp.moe_statics.e_score_correction_bias"]
            assert torch.equal(layer.moe.correction_bias, stored.view(-1))


parallel_engines = parallel_engines_fixture("ernie4.5-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_and_expert_parallel_logits_match_transformers(parallel_engines):
    # tp=2 + ep=2: each rank 2 of the 4 query heads and 1 of the 2 KV heads (each reordered within its heads), half
    # the dense MLPs, half the routed experts, the shared expert whole; the router and its bias whole on each
    assert_prompt_logits(parallel_engines, "ernie4.5-moe", (2, 1, 2), (1, 1, 1))


def _raw(**changes) -> dict:
    moe = changes.pop("moe", False)
    config = (transformers.Ernie4_5_MoeConfig(**ERNIE_MOE) if moe else transformers.Ernie4_5Config(**ERNIE)).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"use_bias": "false"}, CheckpointError, "use_bias must be true or false, got 'false'"),
    ({"tie_word_embeddings": 1}, CheckpointError, "tie_word_embeddings must be true or false, got 1"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
    ({"moe": True, "use_bias": True}, UnsupportedModelError, "use_bias true is not supported for ernie4_5_moe"),
    ({"moe": True, "moe_k": 9}, CheckpointError, "moe_k 9 exceeds the 8 experts"),
    ({"moe": True, "moe_num_experts": [8, 8]}, CheckpointError, "moe_num_experts must be a positive integer"),
    ({"moe": True, "moe_layer_start_index": -1}, CheckpointError,
     "moe_layer_start_index must be a non-negative integer, got -1"),
    ({"moe": True, "moe_layer_end_index": -2}, CheckpointError,
     "moe_layer_end_index must be a layer index or -1"),
    ({"moe": True, "moe_layer_interval": 0}, CheckpointError, "moe_layer_interval must be a positive integer, got 0"),
    ({"moe": True, "moe_num_shared_experts": "2"}, CheckpointError,
     "moe_num_shared_experts must be a non-negative integer, got '2'"),
    ({"moe": True, "moe_norm_min": 0}, CheckpointError, "moe_norm_min must be a positive number, got 0"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(_raw(**changes), Path("config.json"))


@pytest.mark.parametrize("model_type", ["ernie4_5", "ernie4_5_moe"])
def test_omitted_fields_default_as_transformers_defaults_them(model_type):
    raw = {"model_type": model_type, "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
    cfg = parse_config(raw, Path("config.json"))
    make = transformers.Ernie4_5Config if model_type == "ernie4_5" else transformers.Ernie4_5_MoeConfig
    their = make(**{key: value for key, value in raw.items() if key != "model_type"})
    assert cfg.head_dim == getattr(their, "head_dim", their.hidden_size // their.num_attention_heads)
    assert (cfg.rope.theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        their.rope_parameters["rope_theta"], their.rms_norm_eps, their.max_position_embeddings)
    assert (cfg.tie_word_embeddings, cfg.qkv_bias, cfg.bos_token_id, cfg.eos_token_ids) == (
        their.tie_word_embeddings, their.use_bias, their.bos_token_id, [their.eos_token_id])
    # num_key_value_heads omitted: transformers' 2 (dense) or 4 (mixture of experts), not one per query head
    omitted = {**{key: value for key, value in raw.items() if key != "num_key_value_heads"}, "num_attention_heads": 8}
    their_kv_heads = make(**{key: value for key, value in omitted.items() if key != "model_type"}).num_key_value_heads
    assert parse_config(omitted, Path("config.json")).num_kv_heads == their_kv_heads == (
        2 if model_type == "ernie4_5" else 4)
    if model_type == "ernie4_5_moe":
        moe = cfg.moe
        assert (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size, moe.num_shared_experts,
                moe.norm_min) == (their.moe_num_experts, their.moe_k, their.moe_intermediate_size,
                                  their.moe_num_shared_experts, their.moe_norm_min)
        assert moe.sparse_layers == [their.moe_layer_start_index <= i <= their.moe_layer_end_index for i in range(4)]
