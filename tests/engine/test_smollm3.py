"""SmolLM3 checkpoints: the engine computes what transformers computes on the same random-weight checkpoint, read
from the same config.json.

SmolLM3 is Llama's decoder with NoPE layers: no_rope_layers (or every no_rope_layer_interval-th layer) rotates
neither queries nor keys. With use_sliding_window its sliding layers attend a window (the NoPE ones unless layer_types
says otherwise). The rope's theta is small, so rotating a NoPE layer would move the logits far; prompts are longer
than the window, chunked and batched beside decode rows, on the C decode loop and on the torch path; one checkpoint
also runs at tp=2 and from its compressed copy.
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
SMOLLM3 = {**SMALL, "num_hidden_layers": 4, "max_position_embeddings": 64, "rope_theta": 200.0,
           "initializer_range": 0.1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
           "no_rope_layer_interval": 2}


def _smollm3(**kw):
    return transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**{**SMOLLM3, **kw}))


VARIANTS = {
    # SmolLM3-3B's shape, small: tied embeddings, GQA, every second layer NoPE by no_rope_layer_interval (the
    # saved no_rope_layers removed, so the engine derives them as transformers does)
    "smollm3": (lambda: _smollm3(), {"no_rope_layers": None}),
    # no_rope_layers listed, sliding windows on the NoPE layers (layer_types derived), biases, an untied head
    "smollm3-sliding-bias": (lambda: _smollm3(no_rope_layers=[1, 0, 0, 1], use_sliding_window=True,
                                              sliding_window=WINDOW, attention_bias=True, mlp_bias=True,
                                              tie_word_embeddings=False), {"layer_types": None}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "smollm3",
                      "decode attention differs between the paths only in its window")


def test_nope_layers_and_windows_are_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg = parse_config(json.loads((directory / "config.json").read_text()), directory / "config.json")
    config = reference.config
    assert cfg.nope_layers == [not rotates for rotates in config.no_rope_layers[:config.num_hidden_layers]]
    assert any(cfg.nope_layers) and not all(cfg.nope_layers)
    assert cfg.sliding_windows == [config.sliding_window if config.use_sliding_window and kind == "sliding_attention"
                                   else None for kind in config.layer_types]
    assert cfg.tie_word_embeddings == config.tie_word_embeddings


def test_rotating_the_nope_layers_would_not_be_transformers_model(tmp_path):
    # the logits check is sharp: the same engine with every layer rotated is far from transformers' logits
    directory = tmp_path / "smollm3"
    reference = save_random_checkpoint(directory, *VARIANTS["smollm3"])
    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, block_size=8))
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(engine.prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)
    rotating = next(table for table in engine.model.rope_tables if table is not None)
    engine.model.rope_tables = [rotating] * len(engine.model.rope_tables)
    assert (engine.prompt_logits(PROMPT) - theirs).abs().max() > 0.1


def test_a_compressed_checkpoint_gives_the_original_logits_in_both_weight_modes(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["smollm3-sliding-bias"])
    check_compressed_copy(original, compressed)


parallel_engines = parallel_engines_fixture("smollm3-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_parallel_logits_match_transformers(parallel_engines):
    # 4 heads and 2 KV heads over 2 ranks, NoPE and sliding layers on each
    assert_prompt_logits(parallel_engines, "smollm3-sliding-bias", (2, 1), (1, 1))


def _raw(**changes) -> dict:
    config = transformers.SmolLM3Config(**SMOLLM3).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"no_rope_layers": [1, 0, 1]}, CheckpointError, "no_rope_layers must list 1 (rotary) or 0 (no rotary) for each"),
    ({"no_rope_layers": [1, 2, 1, 0]}, CheckpointError, "no_rope_layers must list 1"),
    ({"no_rope_layers": None, "no_rope_layer_interval": 0}, CheckpointError,
     "no_rope_layer_interval must be a positive integer"),
    ({"use_sliding_window": "yes"}, CheckpointError, "use_sliding_window must be true or false"),
    ({"layer_types": ["sliding_attention"] * 4}, CheckpointError, "sliding_window is null"),
    ({"layer_types": ["sliding_attention"] * 4, "sliding_window": 8}, UnsupportedModelError,
     "use_sliding_window is false"),
    ({"layer_types": ["full_attention"] * 3}, CheckpointError, "layer_types must list one of"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
])
def test_smollm3_configs_the_engine_cannot_follow_are_refused_naming_the_key(changes, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    raw = {"model_type": "smollm3", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 8, "num_attention_heads": 4}
    cfg = parse_config(raw, Path("config.json"))
    reference = transformers.SmolLM3Config(**{key: value for key, value in raw.items() if key != "model_type"})
    assert cfg.nope_layers == [not rotates for rotates in reference.no_rope_layers]
    assert cfg.rope.theta == reference.rope_parameters["rope_theta"] == 2000000.0
    assert cfg.tie_word_embeddings is reference.tie_word_embeddings is True
    assert cfg.sliding_windows == [None] * 8
    assert cfg.rms_norm_eps == reference.rms_norm_eps
