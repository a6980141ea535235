"""Gemma 3 (text) checkpoints: the engine computes what transformers computes on the same random-weight
checkpoint, read from the same config.json.

Gemma 3 norms by 1 + weight in float32, norms each attention and MLP output before its residual add,
scales the embeddings by sqrt(hidden_size), activates by GELU-tanh, scales the softmax by
query_pre_attn_scalar, and alternates sliding-window layers (their own unscaled rope) with full-attention
ones (rope_theta with linear scaling). Every prompt but the shortest is longer than the window, so both
kinds of layer shape the logits; prompts are chunked and batched beside decode rows, on the C decode loop
and on the torch path, and one checkpoint also runs at tp=2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import ops
from engine.compression.compress import compress_checkpoint
from engine.config import parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import SMALL, save_random_checkpoint
from tests.engine.family_checks import DECODE_PATHS, check_decode_path, parallel_engines_fixture, variant_fixture
from tests.engine.test_compression_checkpoint import to_bf16
from tests.engine.test_moe import random_prompts
from tests.engine.test_reference import engine_greedy
from tests.engine.test_parallel import Engines, assert_prompt_logits

transformers = pytest.importorskip("transformers")

WINDOW = 6   # shorter than all prompts but the first, and not a multiple of the 8-token blocks
GEMMA3 = {**SMALL, "num_hidden_layers": 6, "head_dim": 16, "initializer_range": 0.1, "max_position_embeddings": 64,
          "sliding_window": WINDOW, "sliding_window_pattern": 3, "query_pre_attn_scalar": 24,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 200.0, "rope_local_base_freq": 30.0}
# The older spelling of the published Gemma 3 configs: theta, local theta and scaling at the top level, every
# sliding_window_pattern-th layer full, no layer_types
OLD_SPELLING = {"rope_parameters": None, "layer_types": None, "rope_theta": 200.0, "rope_local_base_freq": 30.0,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 3}


def _gemma3(**kw):
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**GEMMA3, **kw}))


def _randomize_gemma(model) -> None:
    # Gemma's norms are built at 0 (a scale of 1 + 0); random ones make the test see each of them
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.3 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))


VARIANTS = {
    # Gemma 3 1B/4B's shape, small: tied embeddings, GQA, 2 sliding layers to each full one
    "gemma3": (lambda: _gemma3(), {}),
    # the same checkpoint written in the older config spelling
    "gemma3-old-spelling": (lambda: _gemma3(), OLD_SPELLING),
    # attention_bias, untied embeddings, every other layer full
    "gemma3-bias-untied": (lambda: _gemma3(attention_bias=True, tie_word_embeddings=False,
                                           layer_types=["sliding_attention", "full_attention"] * 3), {}),
}


def _save(directory: Path, factory, config_edits: dict):
    return save_random_checkpoint(directory, factory, config_edits, _randomize_gemma)


variant = variant_fixture(VARIANTS, _randomize_gemma)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "gemma3",
                      "decode attention differs between the paths only in its scale and window")


def test_both_ropes_and_both_window_kinds_are_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg = parse_config(json.loads((directory / "config.json").read_text()), directory / "config.json")
    types = reference.config.layer_types
    assert cfg.sliding_windows == [WINDOW if kind == "sliding_attention" else None for kind in types]
    assert cfg.local_rope_layers == [kind == "sliding_attention" for kind in types]
    rotary = reference.model.rotary_emb
    for rope, kind in ((cfg.rope, "full_attention"), (cfg.local_rope, "sliding_attention")):
        torch.testing.assert_close(ops.rope_inv_freq(cfg.head_dim, rope, 64), getattr(rotary, f"{kind}_inv_freq"))
    assert cfg.tie_word_embeddings == reference.config.tie_word_embeddings


def test_bfloat16_norms_round_after_the_weight_multiply_as_transformers_does():
    # Gemma's (x * (1 + w)).to(bf16), not Llama's x.to(bf16) * w: the float32 weight the loader stores
    torch.manual_seed(0)
    norm = transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm(64).eval()
    with torch.no_grad():
        norm.weight.copy_(0.3 * torch.randn(64))
        x = torch.randn(50, 64).to(torch.bfloat16)
        expected = norm.to(torch.bfloat16)(x)
    ours = ops.rms_norm(x, norm.weight.detach().float() + 1.0, 1e-6)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, expected)


def test_a_compressed_checkpoint_generates_transformers_tokens_in_both_weight_modes(tmp_path):
    # compressed_in_memory runs the MLP on weights decoded layer by layer: the GELU-tanh activation there too
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    _save(original, VARIANTS["gemma3"][0], {})
    to_bf16(original)
    reference = transformers.AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    compress_checkpoint(original, compressed, chunk_size=64, show_progress=False, say=lambda *_: None)
    prompts = random_prompts([9, 20], seed=5)
    for mode in ("decompress_on_load", "compressed_in_memory"):
        engine = LLMEngine(compressed, EngineConfig(kv_cache_bytes=8 << 20, show_progress=False, dtype="float32",
                                                    max_num_batched_tokens=24, block_size=8, weight_mode=mode))
        ours = engine_greedy(engine, prompts, 5)
        for prompt, tokens in zip(prompts, ours):
            with torch.no_grad():
                theirs = reference(torch.tensor([prompt + tokens[:-1]])).logits[0]
            assert theirs[len(prompt) - 1:].argmax(-1).tolist() == tokens, mode


TP_CHECKPOINTS = {"gemma3": VARIANTS["gemma3"][0]}


class _GemmaEngines(Engines):
    def adjust(self, name: str, model: torch.nn.Module) -> None:
        _randomize_gemma(model)


parallel_engines = parallel_engines_fixture("gemma3-parallel", TP_CHECKPOINTS, _GemmaEngines)


@pytest.mark.parallel
def test_tensor_parallel_logits_match_transformers(parallel_engines):
    # 4 heads and 2 KV heads over 2 ranks: each its heads' q/k/v rows (q_norm and k_norm whole), half the MLP
    assert_prompt_logits(parallel_engines, "gemma3", (2, 1), (1, 1))


def _raw(**changes) -> dict:
    config = transformers.Gemma3TextConfig(**GEMMA3).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"final_logit_softcapping": 30.0}, UnsupportedModelError, "final_logit_softcapping 30.0 is not supported"),
    ({"attn_logit_softcapping": 50.0}, UnsupportedModelError, "attn_logit_softcapping 50.0 is not supported"),
    ({"use_bidirectional_attention": True}, UnsupportedModelError, "use_bidirectional_attention true"),
    ({"hidden_activation": "relu"}, UnsupportedModelError, "hidden_activation 'relu' is not supported"),
    ({"layer_types": ["sliding_attention"] * 5}, CheckpointError, "layer_types must list one of"),
    ({"layer_types": ["chunked_attention"] * 6}, CheckpointError, "layer_types must list one of"),
    ({"sliding_window": 0}, CheckpointError, "sliding_window must be a positive integer"),
    ({"query_pre_attn_scalar": -1}, CheckpointError, "query_pre_attn_scalar must be a positive number"),
])
def test_gemma3_configs_the_engine_cannot_follow_are_refused_naming_the_key(changes, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    raw = {"model_type": "gemma3_text", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1}
    cfg = parse_config(raw, Path("config.json"))
    reference = transformers.Gemma3TextConfig(**{key: value for key, value in raw.items() if key != "model_type"})
    assert cfg.head_dim == reference.head_dim == 256
    assert cfg.tie_word_embeddings is reference.tie_word_embeddings is True
    assert cfg.max_position_embeddings == reference.max_position_embeddings
    assert cfg.sliding_windows == [reference.sliding_window if kind == "sliding_attention" else None
                                   for kind in reference.layer_types]
    assert cfg.attention_multiplier == reference.query_pre_attn_scalar ** -0.5
    assert (cfg.rope.theta, cfg.local_rope.theta) == (1000000.0, 10000.0)
    assert cfg.hidden_act == "gelu_pytorch_tanh"
