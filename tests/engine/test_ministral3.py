"""Ministral 3 checkpoints (`ministral3`: Ministral-3-3B, -8B, -14B, published as the text model of the image-and-text
`mistral3`): the engine computes what transformers computes on the same random-weight checkpoint, read from the same
config.json.

Ministral 3 is Mistral's decoder (no biases, a sliding window on every layer when the config gives one) whose queries,
after the rotary, are scaled on every layer by 1 + llama_4_scaling_beta * log(1 + floor(position /
original_max_position_embeddings)), both read from the rope's parameters; its rope is yarn unless the config says
otherwise. Here original_max_position_embeddings is 8, so the scaling steps up every 8 positions within the prompts.
Prompts are chunked and batched beside decode rows, on the C decode loop and on the torch path, at tp=2, from a
compressed copy, and as the text model of a mistral3 checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import load_config, parse_config
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import SMALL, save_and_read_back, save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, check_compressed_copy, check_decode_path,
                                        parallel_engines_fixture, variant_fixture)
from tests.engine.test_moe import check_against_transformers, random_prompts
from tests.engine.test_parallel import assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# The published rope's spelling (both type keys, yarn's mscales), its steps short and its beta large so that the
# scaling moves the logits within the prompts; weights at 5x the default scale
YARN = {"type": "yarn", "rope_type": "yarn", "rope_theta": 300.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}
MINISTRAL3 = {**SMALL, "head_dim": 16, "max_position_embeddings": 128, "initializer_range": 0.1,
              "rope_parameters": YARN}
PIXTRAL = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 2, "head_dim": 16, "image_size": 28, "patch_size": 14}


def _ministral3(**kw):
    return transformers.Ministral3ForCausalLM(transformers.Ministral3Config(**{**MINISTRAL3, **kw}))


VARIANTS = {
    # the published shape: yarn, no sliding window, untied
    "ministral3": (lambda: _ministral3(sliding_window=None), {}),
    # an unscaled rope whose parameters give the scaling's steps; a window of 12 on every layer, tied embeddings
    "ministral3-window-tied": (lambda: _ministral3(sliding_window=12, tie_word_embeddings=True, rope_parameters={
        "rope_type": "default", "rope_theta": 300.0, "original_max_position_embeddings": 8,
        "llama_4_scaling_beta": 0.3}), {}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "ministral3-window-tied",
                      "the decode paths differ in attention only, which one variant covers")


def test_config_is_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg, their = load_config(directory), reference.config
    rope = their.rope_parameters
    assert cfg.position_query_scale == (rope["original_max_position_embeddings"], rope["llama_4_scaling_beta"])
    assert cfg.sliding_windows == [their.sliding_window] * 2 and cfg.rope.rope_type == rope["rope_type"]
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())


def test_the_text_model_of_an_image_and_text_checkpoint_computes_as_transformers(tmp_path):
    """mistral3 with a ministral3 text_config, as Ministral 3 is published: its tensors under language_model.*, the
    image encoder never read."""
    def mistral3():
        config = transformers.Mistral3Config(text_config={**MINISTRAL3, "model_type": "ministral3"},
                                             vision_config=PIXTRAL)
        return transformers.Mistral3ForConditionalGeneration(config)

    reference = save_and_read_back(tmp_path, mistral3)
    assert load_config(tmp_path).position_query_scale == (8, 0.5)
    check_against_transformers(tmp_path, reference, random_prompts([30, 7], seed=3), max_tokens=4)


def test_a_compressed_copy_gives_the_logits_of_its_original(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["ministral3"])
    check_compressed_copy(original, compressed, weight_modes=("compressed_in_memory",))


parallel_engines = parallel_engines_fixture("ministral3-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_parallel_logits_match_transformers(parallel_engines):
    # 4 heads and 2 KV heads over 2 ranks: each rank scales its own heads' queries
    assert_prompt_logits(parallel_engines, "ministral3", (2, 1), (1, 1))


def _raw(**changes) -> dict:
    config = transformers.Ministral3Config(**MINISTRAL3).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"rope_parameters": {**YARN, "llama_4_scaling_beta": None}}, CheckpointError,
     "rope_parameters: llama_4_scaling_beta is missing"),
    ({"rope_parameters": {**YARN, "llama_4_scaling_beta": "0.1"}}, CheckpointError,
     "llama_4_scaling_beta must be a number >= 0, got '0.1'"),
    ({"rope_parameters": {"rope_type": "default", "llama_4_scaling_beta": 0.1}}, CheckpointError,
     "rope_parameters: missing required field 'original_max_position_embeddings'"),
    ({"rope_parameters": {**YARN, "original_max_position_embeddings": 0}}, CheckpointError,
     "original_max_position_embeddings must be a positive integer, got 0"),
    ({"sliding_window": 0}, CheckpointError, "sliding_window must be a positive integer, got 0"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    raw = {"model_type": "ministral3", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 16, "rope_theta": 300.0}
    cfg = parse_config(raw, Path("config.json"))
    # a top-level rope_theta without rope_parameters: transformers' yarn rope all the same, its theta included
    their = transformers.Ministral3Config(**{key: value for key, value in raw.items() if key != "model_type"})
    rope = their.rope_parameters
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.max_position_embeddings, cfg.rms_norm_eps) == (
        their.head_dim, their.num_key_value_heads, their.max_position_embeddings, their.rms_norm_eps) == (
        128, 8, 262144, 1e-5)
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == (
        rope["rope_type"], rope["rope_theta"], rope["factor"], rope["original_max_position_embeddings"])
    assert (cfg.rope.beta_fast, cfg.rope.beta_slow, cfg.rope.attention_factor) == (
        rope["beta_fast"], rope["beta_slow"], 1.0)
    assert cfg.position_query_scale == (rope["original_max_position_embeddings"], rope["llama_4_scaling_beta"])
    assert (cfg.sliding_windows, cfg.qkv_bias, cfg.o_bias, cfg.tie_word_embeddings) == (
        [their.sliding_window] * 2, False, False, their.tie_word_embeddings)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (their.bos_token_id, [their.eos_token_id])
    # a top-level original_max_position_embeddings wins over the yarn rope's own, for the rope and the scaling alike
    cfg = parse_config({**raw, "original_max_position_embeddings": 64}, Path("config.json"))
    assert cfg.rope.original_max_position_embeddings == 64 and cfg.position_query_scale == (64, 0.1)
    # the image-and-text checkpoint's text model: its text_config defaulted the same
    image_text = parse_config({"model_type": "mistral3", "text_config": {**raw, "num_key_value_heads": 2}},
                              Path("config.json"))
    assert image_text.image_text_checkpoint and image_text.position_query_scale == (16384, 0.1)
