"""GLM-4-0414 and GLM-Z1 checkpoints (`glm4`, dense) and GLM-4.7-Flash's (`glm4_moe_lite`): the engine computes what
transformers computes on the same random-weight checkpoint, read from the same config.json.

GLM-4's attention is grouped-query with q/k/v biases (o_proj never has one) and rotary on each head's first
partial_rotary_factor of dims, stored as interleaved pairs (the loader reorders q's and k's rotary rows to the halves
the engine rotates); its MLP's gate and up are one gate_up_proj; each layer has four norms (post_self_attn_layernorm
and post_mlp_layernorm norm the attention's and the MLP's outputs, post_attention_layernorm the MLP's input).
GLM-4.7-Flash is DeepSeek-V3's latent attention (interleaved rotary) and grouped sigmoid routing with shared experts,
its layers dense or sparse as mlp_layer_types says (here the first sparse, the second dense), and its checkpoint
stores a multi-token-prediction layer after the decoder's, which the engine leaves unread as transformers does.
Prompts are chunked and batched beside decode rows on the C decode loop and the torch path, and also run at tp=2
(GLM-4.7-Flash at tp=2 x ep=2) and from a compressed copy.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import load_config, parse_config
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import SMALL, save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, VariantEngines, check_compressed_copy, check_decode_path,
                                        parallel_engines_fixture)
from tests.engine.test_parallel import assert_prompt_logits

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

# Weights 5x the default scale, so that the attention moves the logits (see conftest's DeepSeek-V3); token ids inside
# the 320-token vocabulary
GLM4 = {**SMALL, "head_dim": 32, "initializer_range": 0.1, "pad_token_id": 0, "eos_token_id": [1, 2]}
# 8 routed experts in 2 groups, one group and 2 experts per token, one shared expert; a compressed query
LITE = {**SMALL, "num_key_value_heads": 4, "initializer_range": 0.1, "n_routed_experts": 8, "n_group": 2,
        "topk_group": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "kv_lora_rank": 32, "q_lora_rank": 24,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 24, "mlp_layer_types": ["sparse", "dense"]}

VARIANTS = {
    "glm4": (lambda: transformers.Glm4ForCausalLM(transformers.Glm4Config(**GLM4)), {}),
    "glm4.7-flash": (lambda: transformers.Glm4MoeLiteForCausalLM(transformers.Glm4MoeLiteConfig(**LITE)), {}),
}


def _store_mtp_layer(directory: Path) -> None:
    """A multi-token-prediction layer stored after the decoder's, as GLM-4.7-Flash's checkpoint stores it."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    for name, shape in (("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
                        ("shared_head.norm.weight", (64,)), ("self_attn.kv_b_proj.weight", (160, 32))):
        tensors["model.layers.2." + name] = torch.randn(shape)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    reference = save_random_checkpoint(directory, *VARIANTS[request.param])
    if request.param == "glm4.7-flash":
        _store_mtp_layer(directory)
    return request.param, directory, reference


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    # GLM-4.7-Flash's latent attention is the torch op on either path
    check_decode_path(variant, decode_in_c, monkeypatch, "glm4", "latent attention runs the torch op on both paths",
                      needs_c_attention=variant[0] == "glm4")


def test_memory_sizing_counts_every_parameter(variant):
    """The weights the engine sizes its memory by: GLM-4's four norms a layer, GLM-4.7-Flash's latent attention,
    experts and routing bias (not the stored multi-token-prediction layer, which it leaves unread)."""
    name, directory, reference = variant
    bias = sum(b.numel() for n, b in reference.named_buffers() if n.endswith("e_score_correction_bias"))
    assert load_config(directory).num_parameters() == sum(p.numel() for p in reference.parameters()) + bias


def test_a_compressed_copy_gives_transformers_logits_in_both_weight_modes(variant, tmp_path):
    # compressed_in_memory streams GLM-4's fused gate_up_proj, and GLM-4.7-Flash's dense MLP and experts
    name, directory, _ = variant
    shutil.copytree(directory, tmp_path / "bf16")
    check_compressed_copy(tmp_path / "bf16", tmp_path / "compressed")


parallel_engines = parallel_engines_fixture("glm4-parallel", VARIANTS, VariantEngines)


@pytest.mark.parallel
def test_parallel_logits_match_transformers(parallel_engines):
    # GLM-4 at tp=2: each rank 2 of the 4 query heads and 1 of the 2 KV heads (their interleaved rotary rows reordered
    # per head), its rows of gate_up_proj's gate and up halves. GLM-4.7-Flash at tp=2 x ep=2: the latent attention's
    # heads split, half the routed experts on each expert rank, the shared expert whole
    assert_prompt_logits(parallel_engines, "glm4", (2, 1), (1, 1))
    assert_prompt_logits(parallel_engines, "glm4.7-flash", (2, 1, 2), (1, 1, 1))


ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _raw(model_type: str, **changes) -> dict:
    config = (transformers.Glm4Config(**GLM4) if model_type == "glm4" else transformers.Glm4MoeLiteConfig(**LITE))
    return {**config.to_dict(), **changes}


@pytest.mark.parametrize("model_type, changes, error, message", [
    ("glm4", {"rope_parameters": {**ROPE, "partial_rotary_factor": 1.5}}, CheckpointError,
     "partial_rotary_factor must be a number in (0, 1], got 1.5"),
    ("glm4", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}}, UnsupportedModelError,
     "rope type 'longrope' is not supported for glm4"),
    ("glm4", {"attention_bias": "true"}, CheckpointError, "attention_bias must be true or false, got 'true'"),
    ("glm4", {"head_dim": 0}, CheckpointError, "head_dim must be a positive integer, got 0"),
    ("glm4", {"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
    ("glm4_moe_lite", {"mlp_layer_types": ["sparse", "moe"]}, CheckpointError,
     "mlp_layer_types must list one of dense, sparse per layer (2), got ['sparse', 'moe']"),
    ("glm4_moe_lite", {"rope_interleave": "yes"}, CheckpointError, "rope_interleave must be true or false, got 'yes'"),
    ("glm4_moe_lite", {"rope_parameters": {**ROPE, "partial_rotary_factor": 0.5}}, UnsupportedModelError,
     "partial_rotary_factor below 1 is not supported for glm4_moe_lite"),
    ("glm4_moe_lite", {"attention_bias": True}, UnsupportedModelError,
     "attention_bias true is not supported for multi-head latent attention"),
    ("glm4_moe_lite", {"num_key_value_heads": 2}, UnsupportedModelError,
     "num_key_value_heads 2 differs from num_attention_heads 4"),
    ("glm4_moe_lite", {"n_group": 3}, CheckpointError, "n_group 3 must split the 8 routed experts into equal groups"),
    ("glm4_moe_lite", {"routed_scaling_factor": 0}, CheckpointError,
     "routed_scaling_factor must be a positive number, got 0"),
    ("glm4_moe_lite", {"kv_lora_rank": 0}, CheckpointError, "kv_lora_rank must be a positive integer, got 0"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(model_type, changes, error, message):
    escaped = message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(error, match=escaped):
        parse_config(_raw(model_type, **changes), Path("config.json"))


def _assert_common_defaults(cfg, their) -> None:
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads) == (
        their.vocab_size, their.hidden_size, their.intermediate_size, their.num_hidden_layers,
        their.num_attention_heads)
    assert (cfg.rope.theta, cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (
        their.rope_parameters["rope_theta"], their.rms_norm_eps, their.max_position_embeddings,
        their.tie_word_embeddings)
    their_eos = their.eos_token_id if isinstance(their.eos_token_id, list) else [their.eos_token_id]
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (their.bos_token_id, their_eos)


def test_omitted_fields_default_as_transformers_defaults_them():
    cfg, their = parse_config({"model_type": "glm4"}, Path("config.json")), transformers.Glm4Config()
    _assert_common_defaults(cfg, their)
    assert (cfg.num_kv_heads, cfg.head_dim) == (their.num_key_value_heads, their.head_dim) == (2, 128)
    assert cfg.rotary_dim == int(their.head_dim * their.rope_parameters["partial_rotary_factor"]) == 64
    assert (cfg.qkv_bias, cfg.o_bias) == (their.attention_bias, False)

    cfg, their = parse_config({"model_type": "glm4_moe_lite"}, Path("config.json")), transformers.Glm4MoeLiteConfig()
    _assert_common_defaults(cfg, their)
    mla, moe = cfg.mla, cfg.moe
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim,
            mla.rope_interleave) == (their.q_lora_rank, their.kv_lora_rank, their.qk_nope_head_dim,
                                     their.qk_rope_head_dim, their.v_head_dim, their.rope_interleave)
    assert moe.sparse_layers == [kind == "sparse" for kind in their.mlp_layer_types]
    assert (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size, moe.num_shared_experts) == (
        their.n_routed_experts, their.num_experts_per_tok, their.moe_intermediate_size, their.n_shared_experts)
    assert (moe.num_groups, moe.topk_groups, moe.routed_scaling_factor, moe.norm_topk_prob, moe.scoring) == (
        their.n_group, their.topk_group, their.routed_scaling_factor, their.norm_topk_prob, "sigmoid")
    assert cfg.num_nextn_layers == 1   # the published checkpoint's one stored multi-token-prediction layer
