"""EXAONE 4.0 checkpoints (EXAONE-4.0-32B and -1.2B): the engine computes what transformers computes on the same
random-weight checkpoint, read from the same config.json.

EXAONE 4.0 norms each attention and MLP output before its residual add and neither input (OLMo 2's places), and norms
q and k over each head. The 32B's layers are three sliding-window ones to one full-attention one (layer_types, else
sliding_window_pattern); only the sliding ones rotate, by llama3's scaled rope, the full-attention ones rotate nothing.
The 1.2B has no window: every layer rotates and attends in full. The rope's theta is small and the prompts longer than
the window, so rotating a global layer, or attending past the window, would move the logits far; prompts are chunked
and batched beside decode rows on the C decode loop and on the torch path; the 32B's shape also runs at tp=2 and from
a compressed copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import SMALL, save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, assert_shape_as_transformers, check_compressed_copy,
                                        check_decode_path, parallel_engines_fixture, variant_fixture)
from tests.engine.test_parallel import PROMPT, assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 6   # shorter than all prompts but the first, and not a multiple of the 8-token blocks
EXAONE4 = {**SMALL, "num_hidden_layers": 4, "max_position_embeddings": 64, "initializer_range": 0.1,
           "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# The 32B's rope as its config.json spells it (top-level rope_theta and rope_scaling), scaled within these prompts
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def _exaone4(**kw):
    return transformers.Exaone4ForCausalLM(transformers.Exaone4Config(**{**EXAONE4, **kw}))


VARIANTS = {
    # EXAONE-4.0-32B's shape, small: GQA, untied, layers 0-2 sliding and rotating, layer 3 full and NoPE
    "exaone4-32b": (lambda: _exaone4(sliding_window=WINDOW, sliding_window_pattern=4, rope_parameters={
        **LLAMA3, "rope_theta": 200.0}), {"rope_theta": 200.0, "rope_scaling": LLAMA3, "sliding_window_pattern": "LLLG"}),
    # EXAONE-4.0-1.2B's: no window, every layer full and rotating, tied embeddings
    "exaone4-1.2b": (lambda: _exaone4(sliding_window=None, layer_types=["full_attention"] * 4, tie_word_embeddings=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 200.0}), {}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "exaone4-32b",
                      "decode attention differs between the paths only in its window")


def test_norms_windows_and_nope_layers_are_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg = parse_config(json.loads((directory / "config.json").read_text()), directory / "config.json")
    config = reference.config
    assert (cfg.sandwich_norms, cfg.input_norms, cfg.qk_norm, cfg.qk_norm_over_heads) == (True, False, True, False)
    assert cfg.tie_word_embeddings == config.tie_word_embeddings
    sliding = [config.sliding_window is not None and kind == "sliding_attention" for kind in config.layer_types]
    assert cfg.sliding_windows == [WINDOW if layer else None for layer in sliding]
    rotates = [layer.self_attn.sliding_window is None or layer.self_attn.is_sliding for layer in reference.model.layers]
    assert [not nope for nope in cfg.nope_layers or [False] * 4] == rotates
    assert any(sliding) == (name == "exaone4-32b") and all(rotates) == (name == "exaone4-1.2b")


def test_what_sets_exaone4_apart_moves_the_logits_far_from_transformers(variant):
    # the logits check is sharp: without the q/k norms, with the 32B's global layers rotated or its window dropped,
    # or with the 1.2B's layers unrotated, the same weights are far from transformers' logits
    name, directory, reference = variant
    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, block_size=8))
    model = engine.model
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(engine.prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)

    def far_after(change) -> bool:
        saved = (model.rope_tables, model.sliding_windows, [(layer.q_norm, layer.k_norm) for layer in
                                                             model.weights.layers])
        change()
        distance = (engine.prompt_logits(PROMPT) - theirs).abs().max()
        model.rope_tables, model.sliding_windows = saved[0], saved[1]
        for layer, (q_norm, k_norm) in zip(model.weights.layers, saved[2]):
            layer.q_norm, layer.k_norm = q_norm, k_norm
        return distance > 0.1

    def drop_qk_norms():
        for layer in model.weights.layers:
            layer.q_norm = layer.k_norm = None

    assert far_after(drop_qk_norms)
    rotating = next(table for table in model.rope_tables if table is not None)
    if name == "exaone4-32b":
        assert far_after(lambda: setattr(model, "rope_tables", [rotating] * 4))
        assert far_after(lambda: setattr(model, "sliding_windows", [None] * 4))
    else:
        assert far_after(lambda: setattr(model, "rope_tables", [None] * 4))


def test_a_compressed_copy_gives_transformers_logits_in_both_weight_modes(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["exaone4-32b"])
    check_compressed_copy(original, compressed)


parallel_engines = parallel_engines_fixture("exaone4-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_parallel_logits_match_transformers(parallel_engines):
    # 4 heads and 2 KV heads over 2 ranks, each head normed alone; sliding, NoPE and rotating layers on each rank
    assert_prompt_logits(parallel_engines, "exaone4-32b", (2, 1), (1, 1))


def _raw(**changes) -> dict:
    config = transformers.Exaone4Config(**{**EXAONE4, "sliding_window": WINDOW}).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"layer_types": None, "sliding_window_pattern": "LLLG"}, CheckpointError,
     "sliding_window_pattern must be a positive integer .* when layer_types is not given, got 'LLLG'"),
    ({"layer_types": None, "sliding_window_pattern": 0}, CheckpointError, "sliding_window_pattern must be a positive"),
    ({"sliding_window": None}, CheckpointError, "sliding_window is null but layer_types marks sliding_attention"),
    ({"sliding_window": 0}, CheckpointError, "sliding_window must be a positive integer, got 0"),
    ({"layer_types": ["sliding_attention"] * 3}, CheckpointError, "layer_types must list one of"),
    ({"layer_types": ["local"] * 4}, CheckpointError, "layer_types must list one of"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, UnsupportedModelError, "rope type 'longrope'"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
    ({"rms_norm_eps": 0}, CheckpointError, "rms_norm_eps must be a positive number"),
    ({"tie_word_embeddings": "no"}, CheckpointError, "tie_word_embeddings must be true or false"),
])
def test_exaone4_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    cfg, their = parse_config({"model_type": "exaone4"}, Path("config.json")), transformers.Exaone4Config()
    assert_shape_as_transformers(cfg, their, 128)
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        their.rope_parameters["rope_theta"], their.rope_parameters["rope_type"], their.rms_norm_eps,
        their.max_position_embeddings)
    assert (cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (
        their.tie_word_embeddings, their.bos_token_id, [their.eos_token_id])
    assert cfg.sliding_windows == [their.sliding_window if kind == "sliding_attention" else None
                                   for kind in their.layer_types]
    assert cfg.nope_layers == [kind == "full_attention" for kind in their.layer_types]
    # 64 query heads given, the KV heads omitted: transformers' 32, not one per query head
    cfg = parse_config({"model_type": "exaone4", "num_attention_heads": 64}, Path("config.json"))
    assert cfg.num_kv_heads == transformers.Exaone4Config(num_attention_heads=64).num_key_value_heads == 32
    # no window and no layer_types (which transformers cannot read: a pattern of 0): every layer full and rotating
    cfg = parse_config({"model_type": "exaone4", "sliding_window": None}, Path("config.json"))
    assert cfg.sliding_windows == [None] * 32 and not any(cfg.nope_layers)
