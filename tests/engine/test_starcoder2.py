"""StarCoder2 checkpoints (`starcoder2`: StarCoder2-3B, -7B, -15B): the engine computes what transformers computes on
the same random-weight checkpoint, read from the same config.json.

StarCoder2 is Mistral's decoder with LayerNorms that add a bias (eps norm_epsilon), an MLP of one projection (c_fc)
activated by GELU-tanh into c_proj, a bias on every projection of the attention and the MLP with use_bias (true unless
it says false), every layer attending the last sliding_window tokens (null: all), and tied embeddings unless the config
says otherwise. The first variant is StarCoder2-3B's config.json (as a public Rust test in the code index quotes it)
shrunk, its window too, every other key kept. Prompts are chunked and batched beside decode rows on the C decode loop
and on the torch path, at tp=2 and from a compressed copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import load_config, parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import SMALL, save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, assert_shape_as_transformers, check_compressed_copy,
                                        check_decode_path, parallel_engines_fixture, variant_fixture)
from tests.engine.test_parallel import PROMPT, assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 6   # shorter than all prompts but the first, and not a multiple of the 8-token blocks
# StarCoder2-3B's config.json, shrunk (hidden 3072, 30 layers, 24 heads, intermediate 12288, vocab 49152, window 4096 in
# the original)
STARCODER2_3B = {"architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "vocab_size": 320,
                 "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "max_position_embeddings": 16384, "norm_epsilon": 1e-05,
                 "rope_theta": 999999.4420358813, "sliding_window": WINDOW, "use_bias": True}
STARCODER2 = {**SMALL, "initializer_range": 0.1, "bos_token_id": 0, "eos_token_id": 0}


def _starcoder2(**kw):
    return transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(**{**STARCODER2, **kw}))


VARIANTS = {
    # StarCoder2-3B's config, shrunk, spelled as published (top-level rope_theta; no token ids, no tie_word_embeddings:
    # tied); its weights drawn wider than transformers' init so that the window shows
    "starcoder2-3b": (lambda: transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config.from_dict(
        {**STARCODER2_3B, "initializer_range": 0.1, "bos_token_id": 0, "eos_token_id": 0})),
        {"rope_theta": STARCODER2_3B["rope_theta"], "rope_scaling": None, "bos_token_id": None, "eos_token_id": None,
         "tie_word_embeddings": None, "initializer_range": None}),
    # no biases, no window, untied
    "starcoder2-no-bias": (lambda: _starcoder2(use_bias=False, sliding_window=None, tie_word_embeddings=False,
                                               rope_parameters={"rope_type": "default", "rope_theta": 200.0}), {}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "starcoder2-3b",
                      "decode attention differs between the paths only in its window")


def test_config_is_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg, their = load_config(directory), reference.config
    layer = reference.model.layers[0]
    assert (cfg.layer_norms, cfg.norm_bias, cfg.gated_mlp, cfg.hidden_act) == (True, True, False, their.hidden_act)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (layer.self_attn.q_proj.bias is not None,
                                                        layer.self_attn.o_proj.bias is not None,
                                                        layer.mlp.c_fc.bias is not None)
    assert cfg.rms_norm_eps == layer.input_layernorm.eps == their.norm_epsilon
    assert cfg.sliding_windows == [their.sliding_window] * their.num_hidden_layers
    assert (cfg.tie_word_embeddings, cfg.rope.theta) == (their.tie_word_embeddings, their.rope_parameters["rope_theta"])
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())


@pytest.fixture(scope="module")
def biased_engine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("starcoder2-features")
    reference = save_random_checkpoint(directory, *VARIANTS["starcoder2-3b"])
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    return LLMEngine(directory, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, block_size=8)), theirs


@pytest.mark.parametrize("change", ["norm biases", "MLP biases", "window"])
def test_what_sets_starcoder2_apart_moves_the_logits_far_from_transformers(biased_engine, change, monkeypatch):
    # the logits check is sharp: without the norms' biases or the MLP's, or attending past the window, the same
    # weights are far from transformers' logits
    engine, theirs = biased_engine
    model = engine.model
    torch.testing.assert_close(engine.prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)
    for layer in model.weights.layers:
        if change == "norm biases":
            monkeypatch.setattr(layer, "input_norm_bias", torch.zeros_like(layer.input_norm_bias))
            monkeypatch.setattr(layer, "post_norm_bias", torch.zeros_like(layer.post_norm_bias))
        elif change == "MLP biases":
            monkeypatch.setattr(layer, "gate_up_bias", None)
            monkeypatch.setattr(layer, "down_bias", None)
    if change == "window":
        monkeypatch.setattr(model, "sliding_windows", [None] * len(model.sliding_windows))
    assert (engine.prompt_logits(PROMPT) - theirs).abs().max() > 0.01   # 100 times the check's tolerance


def test_a_compressed_copy_gives_transformers_logits_in_both_weight_modes(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["starcoder2-3b"])
    check_compressed_copy(original, compressed)


parallel_engines = parallel_engines_fixture("starcoder2-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_parallel_logits_match_transformers(parallel_engines):
    # 4 heads and 2 KV heads over 2 ranks with their bias rows; c_fc's rows and bias split, c_proj's bias whole
    assert_prompt_logits(parallel_engines, "starcoder2-3b", (2, 1), (1, 1))


def _raw(**changes) -> dict:
    return {**transformers.Starcoder2Config(**STARCODER2).to_dict(), **changes}


@pytest.mark.parametrize("changes, error, message", [
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported for starcoder2"),
    ({"hidden_act": "silu"}, UnsupportedModelError, "hidden_act 'silu' is not supported for starcoder2"),
    ({"use_bias": "true"}, CheckpointError, "use_bias must be true or false, got 'true'"),
    ({"norm_epsilon": 0}, CheckpointError, "norm_epsilon must be a positive number, got 0"),
    ({"sliding_window": 0}, CheckpointError, "sliding_window must be a positive integer, got 0"),
    ({"tie_word_embeddings": "no"}, CheckpointError, "tie_word_embeddings must be true or false"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, UnsupportedModelError, "rope type 'longrope'"),
])
def test_starcoder2_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    cfg, their = parse_config({"model_type": "starcoder2"}, Path("config.json")), transformers.Starcoder2Config()
    assert_shape_as_transformers(cfg, their, their.hidden_size // their.num_attention_heads)
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        their.rope_parameters["rope_theta"], their.rope_parameters["rope_type"], their.norm_epsilon,
        their.max_position_embeddings)
    assert (cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids, cfg.hidden_act) == (
        their.tie_word_embeddings, their.bos_token_id, [their.eos_token_id], their.hidden_act)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (their.use_bias,) * 3
    assert cfg.sliding_windows == [their.sliding_window] * their.num_hidden_layers
