"""OLMo 2 and OLMo 3 checkpoints: the engine computes what transformers computes on the same random-weight
checkpoint, read from the same config.json.

OLMo 2 norms each attention and MLP output before its residual add and neither input, and its q_norm and k_norm are
RMSNorms over the whole q and k projections (all heads together), multiplying their weights into the float32 row.
OLMo 3 is OLMo 2 with sliding-window layers (three in four by default) rotating by a rope of their own. Prompts are
longer than the window, chunked and batched beside decode rows, on the C decode loop and on the torch path; under
tp=2 each rank holds some heads and the norms' sums of squares are all-reduced (one KV head replicated on both ranks
included); a compressed copy gives the same logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import ops
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
OLMO = {**SMALL, "num_hidden_layers": 4, "max_position_embeddings": 64, "rope_theta": 200.0,
        "initializer_range": 0.1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
OLMO3_ROPES = {"sliding_attention": {"rope_type": "default", "rope_theta": 30.0},
               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 200.0}}
# The older spelling: rope_theta and rope_scaling at the top level (transformers scales and rotates only the
# full-attention layers by them; the sliding ones rotate at its default theta), layer_types left to the default
OLD_SPELLING = {"rope_theta": 200.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "layer_types": None}


def _olmo2(**kw):
    return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**{**OLMO, **kw}))


def _olmo3(**kw):
    return transformers.Olmo3ForCausalLM(transformers.Olmo3Config(**{
        **OLMO, "sliding_window": WINDOW, "rope_parameters": OLMO3_ROPES, **kw}))


VARIANTS = {
    # OLMo-2's shape, small: untied, GQA
    "olmo2": (lambda: _olmo2(), {}),
    # one KV head (replicated on both ranks at tp=2), attention_bias, tied embeddings
    "olmo2-mqa-bias": (lambda: _olmo2(num_key_value_heads=1, attention_bias=True, tie_word_embeddings=True), {}),
    # OLMo 3: sliding layers 0-2, full layer 3, a rope per layer type
    "olmo3": (lambda: _olmo3(), {}),
    "olmo3-old-spelling": (lambda: _olmo3(layer_types=["sliding_attention", "full_attention"] * 2), OLD_SPELLING),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "olmo3",
                      "decode attention differs between the paths only in its window")


def test_norms_windows_and_ropes_are_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg = parse_config(json.loads((directory / "config.json").read_text()), directory / "config.json")
    config = reference.config
    assert (cfg.sandwich_norms, cfg.input_norms, cfg.qk_norm, cfg.qk_norm_over_heads) == (True, False, True, True)
    assert cfg.tie_word_embeddings == config.tie_word_embeddings
    assert cfg.rms_norm_eps == config.rms_norm_eps
    if name.startswith("olmo2"):
        assert cfg.sliding_windows == [None] * config.num_hidden_layers and cfg.local_rope is None
        torch.testing.assert_close(ops.rope_inv_freq(cfg.head_dim, cfg.rope, 64), reference.model.rotary_emb.inv_freq)
        return
    types = config.layer_types
    assert cfg.sliding_windows == [WINDOW if kind == "sliding_attention" else None for kind in types]
    assert cfg.local_rope_layers == [kind == "sliding_attention" for kind in types]
    rotary = reference.model.rotary_emb
    for rope, kind in ((cfg.rope, "full_attention"), (cfg.local_rope, "sliding_attention")):
        torch.testing.assert_close(ops.rope_inv_freq(cfg.head_dim, rope, 64), getattr(rotary, f"{kind}_inv_freq"))


def test_per_head_qk_norms_would_not_be_transformers_model(tmp_path):
    # the logits check is sharp: the same weights normed over each head instead are far from transformers' logits
    directory = tmp_path / "olmo2"
    reference = save_random_checkpoint(directory, *VARIANTS["olmo2"])
    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, block_size=8))
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(engine.prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)
    engine.model.config.qk_norm_over_heads = False
    for layer in engine.model.weights.layers:
        layer.q_norm, layer.k_norm = layer.q_norm.view(-1, 16), layer.k_norm.view(-1, 16)   # per head, same weights
    assert (engine.prompt_logits(PROMPT) - theirs).abs().max() > 1e-2   # 100 times the tolerance


def test_bfloat16_norms_multiply_the_float32_row_as_transformers_does():
    # OLMo 2's (w * x).to(bf16), not Llama's w * x.to(bf16): the float32 weight the loader stores
    torch.manual_seed(0)
    norm = transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm(64, eps=1e-5).eval()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(64))
        x = torch.randn(50, 64).to(torch.bfloat16)
        expected = norm.to(torch.bfloat16)(x)
    ours = ops.rms_norm(x, norm.weight.detach().float(), 1e-5)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, expected)


def test_a_compressed_checkpoint_gives_transformers_logits_in_both_weight_modes(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["olmo3"])
    check_compressed_copy(original, compressed)


parallel_engines = parallel_engines_fixture("olmo-parallel", VARIANTS)


@pytest.mark.parallel
@pytest.mark.parametrize("name", ["olmo2-mqa-bias", "olmo3"])
def test_tensor_parallel_logits_match_transformers(parallel_engines, name):
    # 4 heads over 2 ranks: each rank's q/k norm sums all-reduced; olmo2-mqa-bias's one KV head is on both ranks
    assert_prompt_logits(parallel_engines, name, (2, 1), (1, 1))


def _raw(factory=transformers.Olmo3Config, **changes) -> dict:
    config = factory(**{**OLMO, "sliding_window": WINDOW}).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"sliding_window": None}, CheckpointError, "sliding_window is null but layer_types marks sliding_attention"),
    ({"sliding_window": 0}, CheckpointError, "sliding_window must be a positive integer"),
    ({"layer_types": ["sliding_attention"] * 3}, CheckpointError, "layer_types must list one of"),
    ({"rope_parameters": {"full_attention": {"rope_type": "su"}}}, UnsupportedModelError, "rope type 'su'"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
    ({"rms_norm_eps": -1}, CheckpointError, "rms_norm_eps must be a positive number"),
])
def test_olmo_configs_the_engine_cannot_follow_are_refused_naming_the_key(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    raw = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
           "num_attention_heads": 4}
    for model_type, factory in (("olmo2", transformers.Olmo2Config), ("olmo3", transformers.Olmo3Config)):
        cfg = parse_config({"model_type": model_type, **raw}, Path("config.json"))
        reference = factory(**raw)
        assert cfg.rms_norm_eps == reference.rms_norm_eps == 1e-5
        assert cfg.tie_word_embeddings is reference.tie_word_embeddings is False
        assert cfg.num_kv_heads == reference.num_key_value_heads
        if model_type == "olmo2":
            assert cfg.rope.theta == reference.rope_parameters["rope_theta"] == 10000.0
            continue
        assert cfg.sliding_windows == [reference.sliding_window if kind == "sliding_attention" else None
                                       for kind in reference.layer_types]
        assert (cfg.rope.theta, cfg.local_rope.theta) == (500000.0, 500000.0)
        assert cfg.local_rope_layers == [kind == "sliding_attention" for kind in reference.layer_types]
