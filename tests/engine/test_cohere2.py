"""Command R7B and Command A checkpoints (cohere2), and Command R and R+ (cohere): the engine computes what
transformers computes on the same random-weight checkpoint, read from the same config.json.

Cohere's decoder is a parallel block: one LayerNorm of the residual stream (mean-subtracted, weight, no bias) feeds
both the attention and the MLP, whose outputs are both added to the stream. Its sliding-window layers (three in four)
rotate by an interleaved rotary, which the loader turns into the engine's rotate-half by reordering q's and k's rows;
the full-attention layers rotate nothing; the logits are multiplied by logit_scale. Each of these changes the logits
far beyond the tolerance (checked below). Command R and R+ attend in full and rotate on every layer; R+ norms q and k
per head (use_qk_norm), each head by a weight row of its own. Every prompt but the shortest is longer than the window;
prompts are chunked and batched beside decode rows, on the C decode loop and on the torch path, at tp=2, and from a
compressed copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import loader
from engine.config import parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import SMALL, save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, check_compressed_copy, check_decode_path,
                                        parallel_engines_fixture, variant_fixture)
from tests.engine.test_parallel import PROMPT, assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 6   # shorter than all prompts but the first, and not a multiple of the 8-token blocks
COHERE2 = {**SMALL, "num_hidden_layers": 4, "max_position_embeddings": 64, "initializer_range": 0.2,
           "sliding_window": WINDOW, "logit_scale": 0.5,
           "rope_parameters": {"rope_type": "default", "rope_theta": 200.0},
           "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# The published configs' spelling: rope_theta at the top level, no layer_types (all but every fourth layer sliding)
PUBLISHED_SPELLING = {"rope_parameters": None, "layer_types": None, "rope_theta": 200.0, "sliding_window_pattern": 4}


def _cohere2(**kw):
    return transformers.Cohere2ForCausalLM(transformers.Cohere2Config(**{**COHERE2, **kw}))


def _cohere(**kw):
    config = {key: value for key, value in COHERE2.items() if key != "sliding_window"}
    return transformers.CohereForCausalLM(transformers.CohereConfig(**{**config, **kw}))


VARIANTS = {
    # Command R7B's shape, small: tied embeddings, GQA, three sliding layers and a full one, as published
    "cohere2": (lambda: _cohere2(), PUBLISHED_SPELLING),
    # biases on q, k, v and o, an untied head, heads wider than hidden_size / num_attention_heads, own layer_types
    "cohere2-bias-untied": (lambda: _cohere2(attention_bias=True, tie_word_embeddings=False, logit_scale=1.5,
                                             head_dim=24,
                                             layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                                          "full_attention"]), {}),
    # Command R+'s shape, small: q and k normed per head, every layer rotating, GQA, tied embeddings
    "cohere-qk-norm": (lambda: _cohere(use_qk_norm=True), {}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "cohere2",
                      "decode attention differs between the paths only in its window")


def test_config_is_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg = parse_config(json.loads((directory / "config.json").read_text()), directory / "config.json")
    config = reference.config
    if cfg.model_type == "cohere2":
        sliding = [kind == "sliding_attention" for kind in config.layer_types]
        assert cfg.sliding_windows == [WINDOW if layer else None for layer in sliding]
        assert cfg.nope_layers == [not layer for layer in sliding] and any(sliding) and not all(sliding)
    else:
        assert cfg.sliding_windows == [None] * 4 and not cfg.nope_layers and cfg.qk_norm is config.use_qk_norm
    head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)   # as transformers does
    assert (cfg.head_dim, cfg.logit_scale, cfg.rms_norm_eps) == (head_dim, config.logit_scale, config.layer_norm_eps)
    assert cfg.tie_word_embeddings == config.tie_word_embeddings
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())


def test_each_distinguishing_feature_moves_the_logits_far_beyond_the_tolerance(variant, monkeypatch):
    name, directory, reference = variant
    if name != "cohere2":
        pytest.skip("one checkpoint shows it")
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, block_size=8))
    model, cfg = engine.model, engine.model.config
    torch.testing.assert_close(engine.prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)

    def distance() -> float:
        return (engine.prompt_logits(PROMPT) - theirs).abs().max().item()

    tables = model.rope_tables
    model.rope_tables = [next(table for table in tables if table is not None)] * len(tables)   # full layers rotate
    assert distance() > 0.1
    model.rope_tables = tables
    model.norm_op, model.add_norm_op = "rms_norm", "add_rms_norm"   # RMSNorms in place of LayerNorms
    assert distance() > 0.1
    model.norm_op, model.add_norm_op = "layer_norm", "add_layer_norm"
    monkeypatch.setattr(cfg, "parallel_block", False)   # sequential: the MLP takes the norm of stream + attention
    for layer in model.weights.layers:
        layer.post_norm = layer.input_norm
    assert distance() > 0.1
    engine.shutdown()
    monkeypatch.setattr(loader, "_rotary_halves", lambda rows, head_dim: rows)   # rotated as stored: by halves
    unpermuted = LLMEngine(directory, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, block_size=8))
    assert (unpermuted.prompt_logits(PROMPT) - theirs).abs().max() > 0.1


def test_a_compressed_checkpoint_gives_the_original_logits_in_both_weight_modes(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["cohere2-bias-untied"])
    check_compressed_copy(original, compressed)


parallel_engines = parallel_engines_fixture("cohere2-parallel", VARIANTS)


@pytest.mark.parallel
@pytest.mark.parametrize("name", ["cohere2-bias-untied", "cohere-qk-norm"])
def test_tensor_parallel_logits_match_transformers(parallel_engines, name):
    # 4 heads and 2 KV heads over 2 ranks (each permuted within its heads): biases, rotating and NoPE layers, and q/k
    # norms of each rank's heads' weight rows
    assert_prompt_logits(parallel_engines, name, (2, 1), (1, 1))


def _raw(**changes) -> dict:
    config = (transformers.CohereConfig(**SMALL) if changes.get("model_type") == "cohere"
              else transformers.Cohere2Config(**COHERE2)).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"logit_scale": 0}, CheckpointError, "logit_scale must be a positive number, got 0"),
    ({"logit_scale": -0.25}, CheckpointError, "logit_scale must be a positive number"),
    ({"layer_norm_eps": "1e-5"}, CheckpointError, "layer_norm_eps must be a positive number"),
    ({"layer_types": ["sliding_attention", "global_attention", "sliding_attention", "full_attention"]},
     CheckpointError, "layer_types must list one of sliding_attention, full_attention per layer"),
    ({"sliding_window": None}, CheckpointError, "sliding_window is null but layer_types marks sliding_attention"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
    ({"model_type": "cohere", "use_qk_norm": "yes"}, CheckpointError, "use_qk_norm must be true or false"),
    ({"model_type": "cohere", "layer_norm_eps": 0}, CheckpointError, "layer_norm_eps must be a positive number"),
])
def test_cohere2_configs_the_engine_cannot_follow_are_refused_naming_the_key(changes, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(_raw(**changes), Path("config.json"))


@pytest.mark.parametrize("model_type", ["cohere2", "cohere"])
def test_omitted_fields_default_as_transformers_defaults_them(model_type):
    raw = {"model_type": model_type, "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 8, "num_attention_heads": 4}
    cfg = parse_config(raw, Path("config.json"))
    make = transformers.Cohere2Config if model_type == "cohere2" else transformers.CohereConfig
    reference = make(**{key: value for key, value in raw.items() if key != "model_type"})
    sliding = [kind == "sliding_attention" for kind in getattr(reference, "layer_types", None) or [False] * 8]
    assert cfg.sliding_windows == [reference.sliding_window if layer else None for layer in sliding]
    assert cfg.nope_layers == ([not layer for layer in sliding] if model_type == "cohere2" else [])
    assert cfg.qk_norm is bool(getattr(reference, "use_qk_norm", False))
    assert cfg.rope.theta == reference.rope_parameters["rope_theta"]
    assert (cfg.logit_scale, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        reference.logit_scale, reference.layer_norm_eps, reference.max_position_embeddings)
    assert cfg.tie_word_embeddings is reference.tie_word_embeddings is True
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (reference.bos_token_id, [reference.eos_token_id])
    assert cfg.num_kv_heads == reference.num_key_value_heads
