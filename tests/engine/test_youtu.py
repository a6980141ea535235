"""Youtu-LLM checkpoints (`youtu`: Youtu-LLM-2B): the engine computes what transformers computes on the same
random-weight checkpoint, read from the same config.json.

Youtu-LLM is DeepSeek-V3's latent attention (a compressed query by q_lora_rank, or none; keys and values decompressed
from one normed latent per token, the cache holding that latent and one rotary key; rotary dims interleaved unless
rope_interleave says false; yarn's mscale in the softmax scale) in Llama's layer with a dense MLP on every layer and,
unless the config says otherwise, tied embeddings. One variant is the published config shrunk; prompts are chunked
and batched beside decode rows, on the C decode loop and on the torch path, and also run at tp=2 and from a compressed
copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import load_config, parse_config
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, check_compressed_copy, check_decode_path,
                                        parallel_engines_fixture, variant_fixture)
from tests.engine.test_parallel import assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# Youtu-LLM-2B's config.json as third-party ports quote it (tencent/Youtu-LLM-2B), shrunk, every other key kept: 4
# heads (published 16) of 16 + 8 query/key dims (128 + 64) and 16 value dims (128), a latent of 32 (512), a query
# latent of 24 (1536); weights 5x the default scale so that the attention moves the logits
PUBLISHED = {"hidden_size": 64, "intermediate_size": 128, "kv_lora_rank": 32, "num_attention_heads": 4,
             "num_hidden_layers": 2, "num_key_value_heads": 4, "q_lora_rank": 24, "qk_nope_head_dim": 16,
             "qk_rope_head_dim": 8, "tie_word_embeddings": True, "v_head_dim": 16, "vocab_size": 320,
             "rope_interleave": True, "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 512,
             "initializer_range": 0.1}
# DeepSeek-V3's long-context rope: yarn with an mscale that scales cos/sin and the softmax
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}


def _youtu(**kw):
    return transformers.YoutuForCausalLM(transformers.YoutuConfig(**{**PUBLISHED, **kw}))


VARIANTS = {
    # Youtu-LLM-2B's shape, small: a compressed query, interleaved rotary dims, tied embeddings
    "youtu-llm-2b": (lambda: _youtu(rope_parameters={"rope_type": "default", "rope_theta": 1600000.0}), {}),
    # q_proj straight from the hidden state, rotary dims not interleaved, yarn, values wider than the nope keys,
    # untied embeddings
    "youtu-yarn": (lambda: _youtu(q_lora_rank=None, rope_interleave=False, rope_parameters=YARN, v_head_dim=24,
                                  tie_word_embeddings=False), {}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "youtu-yarn",
                      "latent attention runs the torch attention on either path", needs_c_attention=False)


def test_config_is_what_transformers_reads(variant):
    """Latent attention's geometry, a dense MLP on every layer, the embeddings tied as the config says, and memory
    sizing counting every parameter."""
    name, directory, reference = variant
    cfg, their = load_config(directory), reference.config
    assert (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim,
            cfg.mla.rope_interleave) == (their.q_lora_rank, their.kv_lora_rank, their.qk_rope_head_dim,
                                         their.v_head_dim, their.rope_interleave)
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, their.kv_lora_rank + their.qk_rope_head_dim)   # the latent cache
    assert cfg.moe is None and cfg.tie_word_embeddings == their.tie_word_embeddings == (name == "youtu-llm-2b")
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())


def test_a_compressed_copy_gives_the_logits_of_its_original_in_both_weight_modes(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["youtu-yarn"])
    check_compressed_copy(original, compressed)


parallel_engines = parallel_engines_fixture("youtu-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_parallel_logits_match_transformers(parallel_engines):
    # tp=2: each rank 2 of the 4 heads' query and kv_b rows and o_proj columns, the latent projections whole; half the
    # dense MLP; the tied vocabulary split
    assert_prompt_logits(parallel_engines, "youtu-llm-2b", (2, 1), (1, 1))


def _raw(**changes) -> dict:
    config = transformers.YoutuConfig(**PUBLISHED).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"attention_bias": True}, UnsupportedModelError, "attention_bias true is not supported"),
    ({"num_key_value_heads": 2}, UnsupportedModelError, "num_key_value_heads 2 differs from num_attention_heads 4"),
    ({"qk_rope_head_dim": 7}, CheckpointError, "qk_rope_head_dim must be even, got 7"),
    ({"kv_lora_rank": 0}, CheckpointError, "kv_lora_rank must be a positive integer, got 0"),
    ({"v_head_dim": None}, CheckpointError, "missing required field 'v_head_dim'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}, UnsupportedModelError,
     "rope type 'llama3' is not supported for youtu"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
    ({"tie_word_embeddings": "yes"}, CheckpointError, "tie_word_embeddings must be true or false"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    cfg, their = parse_config({"model_type": "youtu"}, Path("config.json")), transformers.YoutuConfig()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads) == (
        their.vocab_size, their.hidden_size, their.intermediate_size, their.num_hidden_layers,
        their.num_attention_heads)
    assert (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim,
            cfg.mla.v_head_dim, cfg.mla.rope_interleave) == (their.q_lora_rank, their.kv_lora_rank,
                                                             their.qk_nope_head_dim, their.qk_rope_head_dim,
                                                             their.v_head_dim, their.rope_interleave)
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        their.rope_parameters["rope_theta"], their.rope_parameters["rope_type"], their.rms_norm_eps,
        their.max_position_embeddings)
    assert (cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids, cfg.moe) == (
        their.tie_word_embeddings, their.bos_token_id, [their.eos_token_id], None)
