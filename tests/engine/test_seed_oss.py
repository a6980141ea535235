"""Seed-OSS checkpoints (`seed_oss`: Seed-OSS-36B-Base and -Instruct): the engine computes what transformers computes
on the same random-weight checkpoint, read from the same config.json.

Seed-OSS is Llama's decoder with its own bias keys: q, k and v carry biases by attention_bias (true unless the config
says otherwise), o_proj by attention_out_bias, the MLP by mlp_bias; its heads are head_dim wide (128 unless given),
not hidden_size / num_attention_heads; its dropouts apply in training only. Prompts are chunked and batched beside
decode rows, on the C decode loop and on the torch path, at tp=2, and from a compressed copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import load_config, parse_config
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import SMALL, save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, check_compressed_copy, check_decode_path,
                                        parallel_engines_fixture, variant_fixture)
from tests.engine.test_mechanics import make_engine
from tests.engine.test_parallel import assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# Heads 24 wide (hidden_size / num_attention_heads is 16), weights at 5x the default scale so that every bias moves
# the logits; dropouts as published (ignored at inference)
SEED_OSS = {**SMALL, "head_dim": 24, "initializer_range": 0.1, "attention_dropout": 0.1, "residual_dropout": 0.1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 300.0}}
# The published configs' spelling: rope_theta at the top level and a rope_scaling of type default
PUBLISHED_SPELLING = {"rope_parameters": None, "rope_theta": 300.0, "rope_scaling": {"rope_type": "default"}}


def _seed_oss(**kw):
    return transformers.SeedOssForCausalLM(transformers.SeedOssConfig(**{**SEED_OSS, **kw}))


VARIANTS = {
    # Seed-OSS-36B's biases, small: q, k and v (attention_bias), none on o_proj or the MLP
    "seed-oss": (lambda: _seed_oss(), PUBLISHED_SPELLING),
    # every bias on (o_proj's by attention_out_bias, the MLP's by mlp_bias), tied embeddings
    "seed-oss-all-biases": (lambda: _seed_oss(attention_out_bias=True, mlp_bias=True, tie_word_embeddings=True), {}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "seed-oss",
                      "the decode paths differ in attention only, which one variant covers")


def test_config_is_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg, their = load_config(directory), reference.config
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (their.attention_bias, their.attention_out_bias,
                                                       their.mlp_bias)
    assert (cfg.head_dim, cfg.rope.theta, cfg.tie_word_embeddings) == (
        their.head_dim, their.rope_parameters["rope_theta"], their.tie_word_embeddings)
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())


def test_model_info_reports_the_kv_bytes_of_its_heads(variant):
    """GetModelInfo's KV bytes per token: keys and values of head_dim (not hidden_size / num_attention_heads)."""
    from engine.demo import train_tokenizer
    from node_agent.models import _model_info

    name, directory, reference = variant
    if name != "seed-oss":
        pytest.skip("the same for every variant")
    train_tokenizer(320).save(str(directory / "tokenizer.json"))
    their = reference.config
    per_token = their.num_hidden_layers * 2 * their.num_key_value_heads * their.head_dim
    assert _model_info("seed", make_engine(directory)).kv_bytes_per_token == per_token * 4


def test_a_compressed_copy_gives_the_logits_of_its_original(tmp_path):
    # compressed_in_memory: the MLP projections stay compressed and stream, their biases beside them
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["seed-oss-all-biases"])
    check_compressed_copy(original, compressed, weight_modes=("compressed_in_memory",))


parallel_engines = parallel_engines_fixture("seed-oss-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_parallel_logits_match_transformers(parallel_engines):
    # 4 heads and 2 KV heads over 2 ranks: each rank its heads' q/k/v bias rows, half the MLP and its bias rows;
    # o_proj's and down_proj's biases added once
    assert_prompt_logits(parallel_engines, "seed-oss-all-biases", (2, 1), (1, 1))


def _raw(**changes) -> dict:
    config = transformers.SeedOssConfig(**SEED_OSS).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"attention_bias": "true"}, CheckpointError, "attention_bias must be true or false, got 'true'"),
    ({"attention_out_bias": 1}, CheckpointError, "attention_out_bias must be true or false, got 1"),
    ({"mlp_bias": "no"}, CheckpointError, "mlp_bias must be true or false, got 'no'"),
    ({"head_dim": 0}, CheckpointError, "head_dim must be a positive integer, got 0"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    raw = {"model_type": "seed_oss", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    cfg = parse_config(raw, Path("config.json"))
    their = transformers.SeedOssConfig(**{key: value for key, value in raw.items() if key != "model_type"})
    assert (cfg.head_dim, cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (
        their.head_dim, their.attention_bias, their.attention_out_bias, their.mlp_bias) == (128, True, False, False)
    assert (cfg.rope.theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        their.rope_parameters["rope_theta"], their.rms_norm_eps, their.max_position_embeddings)
    assert (cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (
        their.tie_word_embeddings, their.bos_token_id, [their.eos_token_id])
    # a null head_dim: hidden_size / num_attention_heads, as transformers reads it
    assert parse_config({**raw, "head_dim": None}, Path("config.json")).head_dim == 16
    their = transformers.SeedOssConfig(**{key: value for key, value in raw.items() if key != "model_type"},
                                       head_dim=None)
    assert their.head_dim == 16
    # num_key_value_heads omitted: 8 (the published shape's), as transformers reads it, not one per query head
    raw = {**{key: value for key, value in raw.items() if key != "num_key_value_heads"}, "num_attention_heads": 16}
    their = transformers.SeedOssConfig(**{key: value for key, value in raw.items() if key != "model_type"})
    assert parse_config(raw, Path("config.json")).num_kv_heads == their.num_key_value_heads == 8
