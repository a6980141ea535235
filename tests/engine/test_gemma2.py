"""Gemma 2 checkpoints: the engine computes what transformers computes on the same random-weight checkpoint,
read from the same config.json.

Gemma 2 computes as Gemma 3 does (norms by 1 + weight, four a layer, GELU-tanh, sqrt(hidden_size) embedding scale,
query_pre_attn_scalar) with one rope for all layers, no q/k norms, every other layer sliding, and tanh soft-capping
of the scaled attention scores (attn_logit_softcapping) and of the logits (final_logit_softcapping). The caps here
are small and the weights large enough that each cap changes the logits far beyond the tolerance (checked below),
so a missing or misplaced tanh fails. Every prompt but the shortest is longer than the window; prompts are chunked
and batched beside decode rows, on the C decode loop and on the torch path, at tp=2, and from a compressed copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import parse_config
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import SMALL, save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, check_compressed_copy, check_decode_path,
                                        parallel_engines_fixture, variant_fixture)
from tests.engine.test_gemma3 import _GemmaEngines, _randomize_gemma
from tests.engine.test_moe import random_prompts
from tests.engine.test_parallel import PROMPT, assert_prompt_logits

transformers = pytest.importorskip("transformers")

WINDOW = 6   # shorter than all prompts but the first, and not a multiple of the 8-token blocks
CAPS = {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 4.0}
GEMMA2 = {**SMALL, "num_hidden_layers": 4, "head_dim": 16, "initializer_range": 0.2, "max_position_embeddings": 64,
          "sliding_window": WINDOW, "query_pre_attn_scalar": 24, "rope_theta": 200.0, **CAPS}
# The published configs' spelling: rope_theta at the top level, no layer_types (every other layer sliding)
PUBLISHED_SPELLING = {"rope_parameters": None, "layer_types": None, "rope_theta": 200.0}


def _gemma2(**kw):
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**{**GEMMA2, **kw}))


VARIANTS = {
    # Gemma 2's shape, small: tied embeddings, GQA, both caps, as the published configs spell it
    "gemma2": (lambda: _gemma2(), PUBLISHED_SPELLING),
    # null caps (none), attention_bias, untied embeddings, layer_types of its own
    "gemma2-nocaps-bias-untied": (lambda: _gemma2(attention_bias=True, tie_word_embeddings=False,
                                                  attn_logit_softcapping=None, final_logit_softcapping=None,
                                                  layer_types=["full_attention", "sliding_attention",
                                                               "sliding_attention", "full_attention"]), {}),
}


def _save(directory: Path, factory, config_edits: dict):
    return save_random_checkpoint(directory, factory, config_edits, _randomize_gemma)


variant = variant_fixture(VARIANTS, _randomize_gemma)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "gemma2",
                      "decode attention differs between the paths only in its scale, window and cap")


@pytest.mark.parametrize("cap", sorted(CAPS))
def test_each_cap_changes_the_logits_far_beyond_the_tolerance(variant, cap):
    # what makes the comparisons above fail should the engine drop or misplace either tanh
    name, _, reference = variant
    if name != "gemma2":
        pytest.skip("this variant has no caps")
    prompt = torch.tensor(random_prompts([41], seed=11))
    # transformers reads the final cap from the config per call, the attention one once into each layer
    holders = [reference.config] if cap == "final_logit_softcapping" else [
        layer.self_attn for layer in reference.model.layers]
    with torch.no_grad():
        capped = reference(prompt).logits
        try:
            for holder in holders:
                setattr(holder, cap, None)
            uncapped = reference(prompt).logits
        finally:
            for holder in holders:
                setattr(holder, cap, CAPS[cap])
    assert (capped - uncapped).abs().max() > 0.1


def test_config_is_read_as_transformers_reads_it(variant):
    _, directory, reference = variant
    cfg = parse_config(json.loads((directory / "config.json").read_text()), directory / "config.json")
    assert cfg.sliding_windows == [WINDOW if kind == "sliding_attention" else None
                                   for kind in reference.config.layer_types]
    assert cfg.attn_logit_softcapping == reference.config.attn_logit_softcapping
    assert cfg.final_logit_softcapping == reference.config.final_logit_softcapping
    assert cfg.local_rope is None and not cfg.qk_norm   # one rope for every layer, no q/k norms
    assert cfg.rope.theta == reference.config.rope_parameters["rope_theta"]
    assert cfg.tie_word_embeddings == reference.config.tie_word_embeddings


def test_omitted_fields_default_as_transformers_defaults_them():
    raw = {"model_type": "gemma2", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 1}
    cfg = parse_config(raw, Path("config.json"))
    reference = transformers.Gemma2Config(**{key: value for key, value in raw.items() if key != "model_type"})
    assert cfg.head_dim == reference.head_dim == 256
    assert cfg.tie_word_embeddings is reference.tie_word_embeddings is True
    assert cfg.max_position_embeddings == reference.max_position_embeddings
    assert cfg.sliding_windows == [reference.sliding_window if kind == "sliding_attention" else None
                                   for kind in reference.layer_types]
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (
        reference.attn_logit_softcapping, reference.final_logit_softcapping) == (50.0, 30.0)
    assert cfg.attention_multiplier == reference.query_pre_attn_scalar ** -0.5
    assert cfg.rope.theta == reference.rope_parameters["rope_theta"]
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (reference.bos_token_id, [reference.eos_token_id])


def test_a_compressed_copy_gives_transformers_logits_in_both_weight_modes(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    _save(original, VARIANTS["gemma2"][0], PUBLISHED_SPELLING)
    check_compressed_copy(original, compressed, prompt=random_prompts([20], seed=5)[0])


parallel_engines = parallel_engines_fixture("gemma2-parallel", {"gemma2": VARIANTS["gemma2"][0]}, _GemmaEngines)


@pytest.mark.parallel
def test_tensor_parallel_logits_match_transformers(parallel_engines):
    # 4 heads and 2 KV heads over 2 ranks: each caps its heads' scores, and its vocab columns' logits
    assert len(PROMPT) > WINDOW
    assert_prompt_logits(parallel_engines, "gemma2", (2, 1), (1, 1))


def _raw(**changes) -> dict:
    config = transformers.Gemma2Config(**GEMMA2).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"attn_logit_softcapping": -50.0}, CheckpointError, "attn_logit_softcapping must be a positive number, got -50.0"),
    ({"attn_logit_softcapping": 0}, CheckpointError, "attn_logit_softcapping must be a positive number, got 0"),
    ({"final_logit_softcapping": "30"}, CheckpointError, "final_logit_softcapping must be a positive number, got '30'"),
    ({"final_logit_softcapping": True}, CheckpointError, "final_logit_softcapping must be a positive number, got True"),
    ({"use_bidirectional_attention": True}, UnsupportedModelError, "use_bidirectional_attention true"),
    ({"hidden_activation": "relu"}, UnsupportedModelError, "hidden_activation 'relu' is not supported"),
    ({"layer_types": ["sliding_attention"] * 3}, CheckpointError, "layer_types must list one of"),
    ({"query_pre_attn_scalar": 0}, CheckpointError, "query_pre_attn_scalar must be a positive number"),
])
def test_gemma2_configs_the_engine_cannot_follow_are_refused_naming_the_key(changes, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_config(_raw(**changes), Path("config.json"))
