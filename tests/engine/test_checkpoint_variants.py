"""Config variants that published checkpoints use: o_proj and MLP biases, each rope scaling the
families accept (linear, dynamic, yarn on Llama, Mistral, Qwen and Mixtral), keys that only some
families honour, Qwen's sliding-window layers, and the defaults transformers fills in when config.json
leaves a key out. On each the engine computes what transformers computes on the same checkpoint, read
from the same config.json (batched, chunked prefill and decode rows, and the greedy tokens), or refuses
it at load naming the key.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import UnsupportedModelError
from tests.engine.conftest import (_deepseek_v3, _llama, _mistral, _mixtral, _qwen2, _qwen3,
                                   save_random_checkpoint)
from tests.engine.test_moe import check_against_transformers, random_prompts

# Prompts past the 32 positions the scaled ropes below were "trained" at.
LENGTHS = [3, 9, 20, 41, 70]
ORIGINAL = 32

VARIANTS = {
    # attention_bias: q, k, v and o_proj biases; mlp_bias: gate, up and down; head_dim wider than hidden/heads
    "llama-attention-and-mlp-bias": (lambda: _llama(attention_bias=True, mlp_bias=True, head_dim=24), {}),
    "qwen3-attention-bias": (lambda: _qwen3(attention_bias=True, head_dim=32), {}),
    "llama-linear-rope": (lambda: _llama(rope_scaling={"rope_type": "linear", "factor": 4.0}), {}),
    "llama-dynamic-rope": (lambda: _llama(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), {}),
    # Qwen2.5's long-context recipe, in its config.json spelling (the old "type" key)
    "qwen2-yarn": (lambda: _qwen2(rope_scaling={"type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": ORIGINAL}), {}),
    "qwen3-yarn-attention-factor": (lambda: _qwen3(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
        "attention_factor": 0.9}), {}),
    "mixtral-yarn-mscale": (lambda: _mixtral(head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0, "original_max_position_embeddings": ORIGINAL,
        "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "truncate": False}), {}),
    # Llama 3.2's rope on a tied model, with prompts past its original context; a top-level
    # original_max_position_embeddings (Phi-3's spelling) wins over the rope's own, as transformers reads it
    "llama3-rope-top-level-original-context": (lambda: _llama(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0}), {"original_max_position_embeddings": 16}),
    "mistral-linear-rope": (lambda: _mistral(rope_scaling={"rope_type": "linear", "factor": 2.0}), {}),
    # Mistral's attention has no biases: transformers ignores the key, and so must the engine
    "mistral-attention-bias-key-ignored": (_mistral, {"attention_bias": True, "mlp_bias": True}),
    # Keys left out: transformers' Mixtral defaults are rope_theta 1e6 and rms_norm_eps 1e-5, DeepSeek-V3's
    # routed_scaling_factor 2.5
    "mixtral-defaults": (lambda: _mixtral(rope_theta=1e6, rms_norm_eps=1e-5),
                         {"rope_parameters": None, "rope_theta": None, "rms_norm_eps": None}),
    "deepseek-v3-default-scaling": (_deepseek_v3, {"routed_scaling_factor": None}),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_logits_and_greedy_tokens_match_transformers(tmp_path, name):
    factory, edits = VARIANTS[name]
    reference = save_random_checkpoint(tmp_path, factory, edits)
    check_against_transformers(tmp_path, reference, random_prompts(LENGTHS, seed=11), max_tokens=5)


QWEN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=100)


@pytest.mark.parametrize("model_type, fields", [
    # layer_types naming sliding layers, but use_sliding_window false: transformers drops the window
    ("qwen2", dict(num_hidden_layers=2, use_sliding_window=False, sliding_window=16,
                   layer_types=["sliding_attention", "full_attention"])),
    # no max_window_layers: transformers' default 28, so layers 28 and 29 slide
    ("qwen2", dict(num_hidden_layers=30, use_sliding_window=True, sliding_window=16)),
    ("qwen3", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    ("qwen3", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=None, max_window_layers=1)),
])
def test_qwen_sliding_window_layers_are_the_ones_transformers_windows(tmp_path, model_type, fields):
    from transformers import AutoConfig

    raw = {"model_type": model_type, **QWEN, **fields}
    theirs = AutoConfig.for_model(model_type, **QWEN, **fields)
    windows = [theirs.sliding_window if kind == "sliding_attention" else None for kind in theirs.layer_types]
    assert parse_config(raw, tmp_path / "config.json").sliding_windows == windows


@pytest.mark.parametrize("rope_key", ["rope_scaling", "rope_parameters"])
def test_a_rope_whose_frequencies_change_mid_sequence_is_refused_naming_the_key(tmp_path, rope_key):
    """longrope switches every position's frequencies once a sequence passes the original context; the
    keys already cached were rotated with the others, so no paged cache can compute it as transformers does."""
    raw = {"model_type": "llama", **QWEN, "num_hidden_layers": 2,
           rope_key: {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                      "original_max_position_embeddings": 32}}
    with pytest.raises(UnsupportedModelError, match=rf"{rope_key}: rope type 'longrope' is not supported for llama"):
        parse_config(raw, tmp_path / "config.json")


@pytest.mark.parametrize("name", ["llama-attention-and-mlp-bias", "qwen3-attention-bias"])
def test_memory_sizing_counts_the_biases(tmp_path, name):
    """The resident weight count (memory check, GetModelInfo) is every parameter transformers builds,
    o_proj's and the MLP's biases included."""
    from engine.config import load_config

    factory, edits = VARIANTS[name]
    reference = save_random_checkpoint(tmp_path, factory, edits)
    assert load_config(tmp_path).num_parameters() == sum(p.numel() for p in reference.parameters())


@pytest.mark.parallel
def test_biases_under_tensor_parallelism_are_added_once(tmp_path):
    """o_proj's and down's biases are whole on every rank: added after the all-reduce, not summed tp times;
    gate/up's are split with their rows."""
    from engine.engine import EngineConfig, LLMEngine

    factory, edits = VARIANTS["llama-attention-and-mlp-bias"]
    reference = save_random_checkpoint(tmp_path, factory, edits)
    prompt = random_prompts([37], seed=3)[0]
    engine = LLMEngine(tmp_path, EngineConfig(kv_cache_bytes=1 << 20, block_size=8, show_progress=False,
                                              tensor_parallel_size=2))
    try:
        ours = engine.prompt_logits(prompt)
    finally:
        engine.shutdown()
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_rope_tables_cover_the_context_served_not_every_position_the_config_names(tmp_path):
    # Llama 4 Scout's config says 10,485,760 positions: tables for all of them are 10.7 GB per rank, which the KV
    # pool lost (and twice that of host memory while they were built). The engine serves what its pool holds.
    reference = save_random_checkpoint(tmp_path, _llama, {"max_position_embeddings": 1 << 22})
    engine = LLMEngine(tmp_path, EngineConfig(kv_cache_bytes=8 << 20, show_progress=False))
    assert engine.model.cos_table.shape[0] == engine.max_model_len < 1 << 22
    check_against_transformers(tmp_path, reference, random_prompts(LENGTHS, seed=12), max_tokens=5)
