"""Arcee checkpoints (`arcee`: AFM-4.5B): the engine computes what transformers computes on the same random-weight
checkpoint, read from the same config.json.

Arcee is Llama's decoder whose MLP has no gate: up_proj activated by ReLU squared into down_proj (biased with
mlp_bias, as q/k/v/o are with attention_bias). AFM-4.5B's rope is yarn's, which its config.json spells as a top-level
rope_theta beside rope_scaling. Prompts are chunked and batched beside decode rows on the C decode loop and on the torch
path; AFM-4.5B's shape also runs at tp=2 (each rank its rows of up_proj, its columns of down_proj) and from a compressed
copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, assert_shape_as_transformers, check_compressed_copy,
                                        check_decode_path, parallel_engines_fixture, variant_fixture)
from tests.engine.test_parallel import PROMPT, assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# arcee-ai/AFM-4.5B's config.json (as quoted by a public Neuron port of the model, neuronx_distributed_inference's
# NeuronArceeForCausalLM docstring), with the keys transformers reads
AFM_4_5B = {"architectures": ["ArceeForCausalLM"], "model_type": "arcee", "hidden_size": 2560,
            "num_attention_heads": 20, "num_key_value_heads": 4, "num_hidden_layers": 36, "intermediate_size": 18432,
            "vocab_size": 128004, "max_position_embeddings": 65536, "head_dim": 128, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 20.0, "original_max_position_embeddings": 4096},
            "hidden_act": "relu2", "attention_bias": False, "mlp_bias": False, "pad_token_id": 0,
            "tie_word_embeddings": False}
# ... shrunk: tiny sizes, every other key kept (yarn's frequencies and its cos/sin scale differ from the default rope's
# at every position)
SHAPE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "intermediate_size": 96, "vocab_size": 320, "max_position_embeddings": 512, "head_dim": 16}
AFM_TINY = {**AFM_4_5B, **SHAPE, "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2}


def _arcee(**kw):
    config = {key: value for key, value in {**AFM_TINY, **kw}.items() if key not in ("rope_theta", "rope_scaling")}
    rope = {**AFM_TINY["rope_scaling"], "rope_theta": AFM_TINY["rope_theta"]}
    return transformers.ArceeForCausalLM(transformers.ArceeConfig(**{"rope_parameters": rope, **config}))


VARIANTS = {
    # AFM-4.5B's shape, small: GQA, untied, yarn rope spelled as published
    "arcee-afm": (_arcee, {"rope_theta": AFM_4_5B["rope_theta"], "rope_scaling": AFM_4_5B["rope_scaling"]}),
    # every projection biased, embeddings tied, the default rope, one KV head per query head
    "arcee-biases": (lambda: _arcee(attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                    num_key_value_heads=4, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 100.0}), {}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "arcee-afm",
                      "the decode paths differ in attention only, which one variant covers")


def test_config_is_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg = parse_config(json.loads((directory / "config.json").read_text()), directory / "config.json")
    mlp, attention = reference.model.layers[0].mlp, reference.model.layers[0].self_attn
    assert (cfg.gated_mlp, cfg.hidden_act, cfg.rotary_dim, cfg.qk_norm) == (False, "relu2", None, False)
    assert not hasattr(mlp, "gate_proj") and cfg.mlp_bias == (mlp.up_proj.bias is not None)
    assert (cfg.qkv_bias, cfg.o_bias) == (attention.q_proj.bias is not None, attention.o_proj.bias is not None)
    assert cfg.rope.rope_type == reference.config.rope_parameters["rope_type"]
    assert cfg.tie_word_embeddings == reference.config.tie_word_embeddings
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())


def test_the_published_config_is_read_as_transformers_reads_it():
    cfg, their = parse_config(AFM_4_5B, Path("config.json")), transformers.ArceeConfig(**AFM_4_5B)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, cfg.intermediate_size,
            cfg.vocab_size, cfg.max_position_embeddings) == (
        their.hidden_size, their.num_attention_heads, their.num_key_value_heads, their.head_dim,
        their.num_hidden_layers, their.intermediate_size, their.vocab_size, their.max_position_embeddings)
    rope = their.rope_parameters
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == (
        rope["rope_type"], rope["rope_theta"], rope["factor"], rope["original_max_position_embeddings"])
    assert (cfg.gated_mlp, cfg.hidden_act, cfg.qkv_bias, cfg.mlp_bias, cfg.rms_norm_eps) == (
        False, their.hidden_act, their.attention_bias, their.mlp_bias, their.rms_norm_eps)


def test_what_sets_arcee_apart_moves_the_logits_far_from_transformers(variant):
    # the logits check is sharp: with the MLP's ReLU not squared, or another ungated activation, the same weights are
    # far from transformers' logits
    name, directory, reference = variant
    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, block_size=8))
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(engine.prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)
    for activation in (torch.relu, torch.nn.functional.gelu):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(engine.model.ops, "relu_squared", activation)
            assert (engine.prompt_logits(PROMPT) - theirs).abs().max() > 0.1


def test_a_compressed_copy_gives_transformers_logits_in_both_weight_modes(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["arcee-afm"])
    check_compressed_copy(original, compressed)


parallel_engines = parallel_engines_fixture("arcee-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_parallel_logits_match_transformers(parallel_engines):
    # 4 heads and 2 KV heads over 2 ranks; each rank its half of up_proj's rows and down_proj's columns
    assert_prompt_logits(parallel_engines, "arcee-afm", (2, 1), (1, 1))
    # biased: up_proj's bias rows split with its rows, down_proj's and o_proj's added once after the all-reduce
    assert_prompt_logits(parallel_engines, "arcee-biases", (2, 1), (1, 1))


def _raw(**changes) -> dict:
    return {**AFM_TINY, **changes}


@pytest.mark.parametrize("changes, error, message", [
    ({"hidden_act": "silu"}, UnsupportedModelError, "hidden_act 'silu' is not supported for arcee .supported: relu2"),
    ({"hidden_act": None}, UnsupportedModelError, "hidden_act None is not supported for arcee"),
    ({"partial_rotary_factor": 0.5}, UnsupportedModelError,
     "partial_rotary_factor below 1 is not supported for arcee .its attention rotates all 16 dims"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, UnsupportedModelError, "rope type 'longrope'"),
    ({"mlp_bias": "no"}, CheckpointError, "mlp_bias must be true or false, got 'no'"),
    ({"intermediate_size": 0}, CheckpointError, "intermediate_size must be a positive integer, got 0"),
])
def test_arcee_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    cfg, their = parse_config({"model_type": "arcee"}, Path("config.json")), transformers.ArceeConfig()
    assert_shape_as_transformers(cfg, their, their.head_dim)
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        their.rope_parameters["rope_theta"], their.rope_parameters["rope_type"], their.rms_norm_eps,
        their.max_position_embeddings)
    assert (cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids, cfg.hidden_act) == (
        their.tie_word_embeddings, their.bos_token_id, [their.eos_token_id], their.hidden_act)
    assert (cfg.gated_mlp, cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (False, False, False, False)
