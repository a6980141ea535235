"""nanochat checkpoints (`nanochat`: nanochat-d20, -d32 in transformers' layout): the engine computes what transformers
computes on the same random-weight checkpoint, read from the same config.json.

nanochat is Llama's layer whose every norm is an RMSNorm without a weight (the attention's and the MLP's inputs, the
final norm, and the same norm of the embeddings before the first layer); q and k are so normed over each head after the
rotary, which turns each pair the other way (rotate-half's signs flipped); the MLP is ungated, fc1 activated by a
squared ReLU into fc2; the logits are soft-capped by tanh (final_logit_softcapping). Its checkpoints store no norm
tensor at all. The first variant is nanochat-d20's config (as a public nanochat-to-transformers converter writes it)
shrunk, every other key kept. Prompts are chunked and batched beside decode rows, on the C decode loop and on the torch
path, at tp=2, and from a compressed copy (its fc1 and fc2 kept compressed in memory).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from engine.compression.streamed import StreamedLayers
from engine.config import parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, assert_shape_as_transformers, check_compressed_copy,
                                        check_decode_path, parallel_engines_fixture, sharp_logits_check,
                                        variant_fixture)
from tests.engine.test_parallel import assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# nanochat-d20's config.json as a public nanochat-to-transformers converter writes it (its build_config, with d20's
# n_layer 20, n_head 10, n_kv_head 10, n_embd 1280, vocab 65536, sequence_len 2048; the converter checks its tensor
# layout against the published nanochat-students/nanochat-d20: six tensors a layer, the embeddings and lm_head)
NANOCHAT_D20 = {"architectures": ["NanoChatForCausalLM"], "model_type": "nanochat", "vocab_size": 65536,
                "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 20, "num_attention_heads": 10,
                "num_key_value_heads": 10, "max_position_embeddings": 2048, "hidden_act": "relu2", "rms_norm_eps": 1e-6,
                "attention_bias": False, "tie_word_embeddings": False, "final_logit_softcapping": 15.0,
                "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "torch_dtype": "bfloat16"}
# ... shrunk, every other key kept: 4 heads of 16 (MHA, as published), the MLP 4x hidden_size wide (as published),
# weights 5x the default scale
NANOCHAT_TINY = {**NANOCHAT_D20, "vocab_size": 320, "hidden_size": 64, "intermediate_size": 256,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                 "max_position_embeddings": 512, "initializer_range": 0.1}


def _nanochat(**kw):
    config = {key: value for key, value in {**NANOCHAT_TINY, **kw}.items() if key != "model_type"}
    return transformers.NanoChatForCausalLM(transformers.NanoChatConfig(**config))


VARIANTS = {
    # nanochat-d20's config shrunk: untied, MHA, logits capped at 15
    "nanochat-d20": (_nanochat, {}),
    # 2 KV heads (one per rank at tp=2), q/k/v/o biased, tied embeddings, no cap, transformers' default rope
    "nanochat-gqa": (lambda: _nanochat(num_key_value_heads=2, attention_bias=True, tie_word_embeddings=True,
                                       final_logit_softcapping=None, rope_parameters=None), {}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "nanochat-gqa",
                      "the decode paths differ in attention only, which one variant covers")


def test_config_is_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg = parse_config(json.loads((directory / "config.json").read_text()), directory / "config.json")
    their, attention = reference.config, reference.model.layers[0].self_attn
    assert (cfg.gated_mlp, cfg.hidden_act, cfg.norm_weights, cfg.embedding_norm, cfg.rope_reversed, cfg.qk_norm) == (
        False, their.hidden_act, False, True, True, False)
    assert cfg.l2_qk_norm_layers == [True] * their.num_hidden_layers
    assert (cfg.qkv_bias, cfg.o_bias) == (attention.q_proj.bias is not None, attention.o_proj.bias is not None)
    assert (cfg.final_logit_softcapping, cfg.tie_word_embeddings, cfg.rms_norm_eps) == (
        their.final_logit_softcapping, their.tie_word_embeddings, their.rms_norm_eps)
    assert (cfg.rope.rope_type, cfg.rope.theta) == (their.rope_parameters["rope_type"],
                                                    their.rope_parameters["rope_theta"])
    # no norm has a weight: the engine's ones are not the checkpoint's parameters
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())


def test_the_published_config_is_read_as_transformers_reads_it():
    cfg = parse_config(NANOCHAT_D20, Path("config.json"))
    their = transformers.NanoChatConfig(**{k: v for k, v in NANOCHAT_D20.items() if k != "model_type"})
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.vocab_size, cfg.max_position_embeddings) == (
        their.hidden_size, their.num_hidden_layers, their.num_attention_heads, their.num_key_value_heads, 128,
        their.intermediate_size, their.vocab_size, their.max_position_embeddings)
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rms_norm_eps, cfg.final_logit_softcapping, cfg.torch_dtype) == (
        their.rope_parameters["rope_type"], their.rope_parameters["rope_theta"], their.rms_norm_eps,
        their.final_logit_softcapping, "bfloat16")
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.tie_word_embeddings, cfg.hidden_act) == (
        their.bos_token_id, [their.eos_token_id], False, "relu2")


def test_the_checkpoint_stores_no_norm(variant):
    # as published: six tensors a layer (q, k, v, o, fc1, fc2), the embeddings and an untied lm_head, which the
    # other tests' engines load; no norm tensor, so a weight in the engine's norms could only be its own ones
    name, directory, reference = variant
    names = load_file(directory / "model.safetensors").keys()
    assert not any("norm" in n for n in names)
    per_layer = {n.split(".", 3)[3] for n in names if n.startswith("model.layers.0.")}
    biases = {f"self_attn.{p}_proj.bias" for p in "qkvo"} if reference.config.attention_bias else set()
    assert per_layer == {f"self_attn.{p}_proj.weight" for p in "qkvo"} | {"mlp.fc1.weight", "mlp.fc2.weight"} | biases
    tied = reference.config.tie_word_embeddings
    assert ("lm_head.weight" in names) is not tied


def test_what_sets_nanochat_apart_moves_the_logits_far_from_transformers(variant):
    # the logits check is sharp: with Llama's rotary direction, without the norm of the embeddings or of q and k, with
    # another ungated activation, or without the cap, the same weights are far from transformers' logits
    engine, far_after = sharp_logits_check(variant, 1e-2)
    model = engine.model

    assert far_after(lambda patch: patch.setattr(model, "rope_tables", [(c, -s) for c, s in model.rope_tables]))
    assert far_after(lambda patch: patch.setattr(model, "embedding_norm", None))
    assert far_after(lambda patch: patch.setattr(model, "l2_qk_norms", [None] * len(model.l2_qk_norms)))
    assert far_after(lambda patch: patch.setattr(model, "act_and_mul", "gelu_tanh"))
    if model.config.final_logit_softcapping is not None:
        assert far_after(lambda patch: patch.setattr(model.config, "final_logit_softcapping", None))


def test_a_compressed_copy_gives_transformers_logits_in_both_weight_modes(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["nanochat-d20"])
    check_compressed_copy(original, compressed)
    # compressed_in_memory keeps every layer's fc1 and fc2 compressed, decoded layer by layer
    engine = LLMEngine(compressed, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, dtype="float32",
                                                block_size=8, weight_mode="compressed_in_memory"))
    layers = engine.model.weights.layers
    assert isinstance(layers, StreamedLayers) and layers.num_compressed == NANOCHAT_TINY["num_hidden_layers"]


parallel_engines = parallel_engines_fixture("nanochat-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_parallel_logits_match_transformers(parallel_engines):
    # 4 heads and 2 KV heads over 2 ranks, each head normed alone; each rank half of fc1's rows and fc2's columns and
    # of the vocabulary, the embeddings normed after their all-reduce
    assert_prompt_logits(parallel_engines, "nanochat-gqa", (2, 1), (1, 1))


def _raw(**changes) -> dict:
    return {**NANOCHAT_TINY, **changes}


@pytest.mark.parametrize("changes, error, message", [
    ({"hidden_act": "gelu"}, UnsupportedModelError,
     "hidden_act 'gelu' is not supported for nanochat .supported: relu2"),
    ({"final_logit_softcapping": 0}, CheckpointError, "final_logit_softcapping must be a positive number, got 0"),
    ({"partial_rotary_factor": 0.5}, UnsupportedModelError,
     "partial_rotary_factor below 1 is not supported for nanochat"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, UnsupportedModelError, "rope type 'longrope'"),
    ({"attention_bias": "no"}, CheckpointError, "attention_bias must be true or false, got 'no'"),
    ({"rms_norm_eps": 0}, CheckpointError, "rms_norm_eps must be a positive number, got 0"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    cfg, their = parse_config({"model_type": "nanochat"}, Path("config.json")), transformers.NanoChatConfig()
    assert_shape_as_transformers(cfg, their, 128)
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        their.rope_parameters["rope_type"], their.rope_parameters["rope_theta"], their.rms_norm_eps,
        their.max_position_embeddings)
    assert (cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids, cfg.hidden_act,
            cfg.final_logit_softcapping) == (their.tie_word_embeddings, their.bos_token_id, [their.eos_token_id],
                                             their.hidden_act, their.final_logit_softcapping)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.gated_mlp) == (False, False, False, False)
    # a null cap: none, as transformers reads it
    assert parse_config({"model_type": "nanochat", "final_logit_softcapping": None},
                        Path("config.json")).final_logit_softcapping is None
