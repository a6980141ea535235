"""Code World Model checkpoints (`cwm`: CWM-32B): the engine computes what transformers computes on the same
random-weight checkpoint, read from the same config.json.

CWM is Llama's decoder without attention biases whose layers attend the last sliding_window tokens, but for the
full-attention ones: those layer_types names, or without it every fourth from the first (CWM-32B: one full layer to
three sliding ones), all rotating by one llama3-scaled rope. The prompts are longer than the window, so attending
past it, or windowing a full layer, moves the logits far; prompts are chunked and batched beside decode rows on the C
decode loop and on the torch path, at tp=2 and from a compressed copy. No published config.json of CWM was found in
the public index; transformers' CwmConfig defaults (CWM-32B's shape) stand in for it.
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
from tests.engine.family_checks import (DECODE_PATHS, check_compressed_copy, check_decode_path,
                                        parallel_engines_fixture, variant_fixture)
from tests.engine.test_parallel import PROMPT, assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 6   # shorter than all prompts but the first, and not a multiple of the 8-token blocks
CWM = {**SMALL, "num_hidden_layers": 4, "head_dim": 16, "max_position_embeddings": 64, "initializer_range": 0.1,
       "bos_token_id": 1, "eos_token_id": 2, "sliding_window": WINDOW}
# CWM-32B's rope (llama3, as transformers defaults it) with a small theta and original context, scaled within these
# prompts
LLAMA3 = {"rope_type": "llama3", "rope_theta": 200.0, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def _cwm(**kw):
    return transformers.CwmForCausalLM(transformers.CwmConfig(**{**CWM, **kw}))


VARIANTS = {
    # CWM-32B's shape, small: layer_types omitted (layers 0 full, 1-3 sliding), untied, llama3 rope
    "cwm-32b": (lambda: _cwm(rope_parameters=LLAMA3), {"layer_types": None}),
    # layer_types of its own (full layers 1 and 3), MLP biases, tied embeddings
    "cwm-layer-types": (lambda: _cwm(layer_types=["sliding_attention", "full_attention"] * 2, mlp_bias=True,
                                     tie_word_embeddings=True,
                                     rope_parameters={"rope_type": "default", "rope_theta": 200.0}), {}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "cwm-32b",
                      "decode attention differs between the paths only in its window")


def test_windows_and_biases_are_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg = parse_config(json.loads((directory / "config.json").read_text()), directory / "config.json")
    layers = reference.model.layers
    assert cfg.sliding_windows == [layer.self_attn.sliding_window for layer in layers]
    assert cfg.sliding_windows[0] is None if name == "cwm-32b" else cfg.sliding_windows[1] is None
    attention = layers[0].self_attn
    assert (cfg.qkv_bias, cfg.o_bias) == (attention.q_proj.bias is not None, attention.o_proj.bias is not None)
    assert cfg.mlp_bias == (layers[0].mlp.up_proj.bias is not None)
    assert cfg.tie_word_embeddings == reference.config.tie_word_embeddings
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())


def test_attending_past_the_window_or_windowing_a_full_layer_moves_the_logits_far(variant):
    name, directory, reference = variant
    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, block_size=8))
    model = engine.model
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(engine.prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)
    windows = model.sliding_windows
    for changed in ([None] * 4, [WINDOW] * 4):
        model.sliding_windows = changed
        assert (engine.prompt_logits(PROMPT) - theirs).abs().max() > 0.1, changed
    model.sliding_windows = windows


def test_a_compressed_copy_gives_transformers_logits_in_both_weight_modes(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["cwm-32b"])
    check_compressed_copy(original, compressed)


parallel_engines = parallel_engines_fixture("cwm-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_parallel_logits_match_transformers(parallel_engines):
    # 4 heads and 2 KV heads over 2 ranks, sliding and full layers on each; the MLP's bias rows split
    assert_prompt_logits(parallel_engines, "cwm-layer-types", (2, 1), (1, 1))


def _raw(**changes) -> dict:
    config = transformers.CwmConfig(**CWM).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"sliding_window": 0}, CheckpointError, "sliding_window must be a positive integer, got 0"),
    ({"sliding_window": None}, CheckpointError, "missing required field 'sliding_window'"),
    ({"layer_types": ["sliding_attention"] * 3}, CheckpointError, "layer_types must list one of"),
    ({"layer_types": ["chunked_attention"] * 4}, CheckpointError, "layer_types must list one of"),
    ({"mlp_bias": "no"}, CheckpointError, "mlp_bias must be true or false"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, UnsupportedModelError, "rope type 'longrope'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0, "factor": 8.0}}, CheckpointError,
     "llama3 rope scaling lacks 'low_freq_factor'"),
])
def test_cwm_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    cfg, their = parse_config({"model_type": "cwm"}, Path("config.json")), transformers.CwmConfig()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.max_position_embeddings, cfg.rms_norm_eps) == (
        their.vocab_size, their.hidden_size, their.intermediate_size, their.num_hidden_layers,
        their.num_attention_heads, their.num_key_value_heads, their.head_dim, their.max_position_embeddings,
        their.rms_norm_eps)
    rope = their.rope_parameters
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor, cfg.rope.low_freq_factor, cfg.rope.high_freq_factor,
            cfg.rope.original_max_position_embeddings) == (
        rope["rope_type"], rope["rope_theta"], rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
        rope["original_max_position_embeddings"])
    assert (cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (
        their.tie_word_embeddings, their.bos_token_id, their.eos_token_id)
    assert cfg.sliding_windows == [their.sliding_window if kind == "sliding_attention" else None
                                   for kind in their.layer_types]
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (False, False, their.mlp_bias)
    # a top-level rope_theta without rope_parameters or rope_scaling changes nothing, as transformers reads it; with
    # a rope_scaling it is that rope's theta
    cfg = parse_config({"model_type": "cwm", "rope_theta": 500000.0}, Path("config.json"))
    assert cfg.rope.theta == transformers.CwmConfig(rope_theta=500000.0).rope_parameters["rope_theta"] == 1e6
    scaling = {"rope_type": "linear", "factor": 2.0}
    cfg = parse_config({"model_type": "cwm", "rope_theta": 500000.0, "rope_scaling": scaling}, Path("config.json"))
    their = transformers.CwmConfig.from_dict({"rope_theta": 500000.0, "rope_scaling": scaling}).rope_parameters
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor) == (
        their["rope_type"], their["rope_theta"], their["factor"])
