"""Mistral Small 4 checkpoints (`mistral4`, published as the text model of the image-and-text `mistral3`): the engine
computes what transformers computes on the same random-weight checkpoint, read from the same config.json.

Mistral 4 is DeepSeek-V3's multi-head latent attention (engine.mla: a latent KV cache, a compressed query unless
q_lora_rank is null, interleaved rotary unless rope_interleave is false, yarn's softmax scale) and experts (the first
first_k_dense_replace layers dense, shared experts), routed by a softmax over the router's logits without correction
bias, a token's choice restricted to the topk_group groups whose best two scores sum highest, the chosen scores
renormalized (norm_topk_prob) and scaled; its whole query is scaled, as Ministral 3's, by 1 + llama_4_scaling_beta *
log(1 + floor(position / original_max_position_embeddings)): here every 8 positions, within the prompts. Prompts are
chunked and batched beside decode rows, at tp=2 with ep=2, from a compressed copy, and as mistral3's text model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.compression.compress import compress_checkpoint
from engine.config import load_config, parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from engine.moe import route_grouped
from tests.engine.conftest import SMALL, save_and_read_back
from tests.engine.family_checks import DECODE_PATHS, check_decode_path, parallel_engines_fixture
from tests.engine.test_compression_checkpoint import to_bf16
from tests.engine.test_parallel import PROMPT, Engines, assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# Weights 5x the default scale, so that the attention moves the logits; the scaling's steps 8 positions long and its
# beta large; the top-3 of the best 2 of 4 groups (a plain top-3 often spans 3 groups), one dense layer
YARN = {"type": "yarn", "rope_type": "yarn", "rope_theta": 300.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}
MISTRAL4 = {**SMALL, "num_key_value_heads": 4, "max_position_embeddings": 128, "initializer_range": 0.1,
            "n_routed_experts": 8, "moe_intermediate_size": 24, "kv_lora_rank": 32, "q_lora_rank": 24,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 24, "n_group": 4, "topk_group": 2,
            "num_experts_per_tok": 3, "first_k_dense_replace": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.0,
            "rope_parameters": YARN}
# a plain q_proj, rotary dims in halves, yarn without mscales (an unscaled softmax), every layer sparse, unnormalized
# weights
PLAIN = {**MISTRAL4, "q_lora_rank": None, "rope_interleave": False, "first_k_dense_replace": 0, "norm_topk_prob": False,
         "routed_scaling_factor": 1.0, "rope_parameters": {"rope_type": "yarn", "rope_theta": 300.0, "factor": 2.0,
                                                           "original_max_position_embeddings": 8,
                                                           "llama_4_scaling_beta": 0.3}}
PIXTRAL = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 2, "head_dim": 16, "image_size": 28, "patch_size": 14}


def _mistral4(config: dict = MISTRAL4):
    return transformers.Mistral4ForCausalLM(transformers.Mistral4Config(**config))


def _mistral3_mistral4():
    config = transformers.Mistral3Config(text_config={**PLAIN, "model_type": "mistral4"}, vision_config=PIXTRAL)
    return transformers.Mistral3ForConditionalGeneration(config)


# the text model alone, and as Mistral Small 4 is published: mistral3's text model (its tensors under
# model.language_model.*, the image encoder never read)
VARIANTS = {"mistral4": _mistral4, "mistral3-mistral4": _mistral3_mistral4}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, save_and_read_back(directory, VARIANTS[request.param])


def _text_model(reference):
    return getattr(reference.model, "language_model", reference.model)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    """Every row of batched chunked prefill and decode steps; the C decode loop declines the latent cache, so both
    paths attend with the torch op: the second checks that the fallback is whole."""
    check_decode_path(variant, decode_in_c, monkeypatch, "mistral4",
                      "the decode paths differ in attention only, which one variant covers", needs_c_attention=False)


def test_routing_matches_transformers_router(variant):
    """The same experts and weights as transformers' router for every token, spread and near-tie ones; a plain top-k
    or DeepSeek-V2's group ranking (a group's best score alone) would pick other experts."""
    name, directory, reference = variant
    moe = load_config(directory).moe
    gate = _text_model(reference).layers[-1].mlp.gate
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(300, 64, generator=generator), 0.01 * torch.randn(20, 64, generator=generator)])
    with torch.no_grad():
        _, their_weights, their_ids = gate(x)
    weights, ids = route_grouped(x, gate.weight, None, moe)
    for row in range(x.shape[0]):   # slot order is free (the reference leaves its top-k unsorted)
        mine = sorted(zip(ids[row].tolist(), weights[row].tolist()))
        ref = sorted(zip(their_ids[row].tolist(), their_weights[row].tolist()))
        assert [e for e, _ in mine] == [e for e, _ in ref], row
        torch.testing.assert_close(torch.tensor([w for _, w in mine]), torch.tensor([w for _, w in ref]))
    plain_topk, v2_group_ranking = (dataclasses.replace(moe, num_groups=1, topk_groups=1),
                                    dataclasses.replace(moe, group_score_experts=1))
    for other in (plain_topk, v2_group_ranking):
        assert (route_grouped(x, gate.weight, None, other)[1].sort().values != ids.sort().values).any(-1).sum() > 5


def test_config_is_what_transformers_reads(variant):
    from engine.model import mla_softmax_scale

    name, directory, reference = variant
    cfg, their = load_config(directory), reference.config.get_text_config()
    rope = their.rope_parameters
    assert cfg.position_query_scale == (rope["original_max_position_embeddings"], rope["llama_4_scaling_beta"])
    assert (cfg.mla.q_lora_rank, cfg.mla.rope_interleave) == (their.q_lora_rank, their.rope_interleave)
    assert (cfg.moe.scoring, cfg.moe.norm_topk_prob, cfg.moe.routed_scaling_factor) == (
        "softmax", their.norm_topk_prob, their.routed_scaling_factor)
    assert cfg.moe.sparse_layers == [i >= their.first_k_dense_replace for i in range(2)]
    attention = _text_model(reference).layers[0].self_attn
    assert mla_softmax_scale(cfg) == pytest.approx(attention.scaling)
    text_parameters = sum(p.numel() for n, p in reference.named_parameters()
                          if not n.startswith(("model.vision_tower.", "model.multi_modal_projector.")))
    assert cfg.num_parameters() == text_parameters


def test_a_compressed_copy_gives_the_logits_of_its_original(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_and_read_back(original, _mistral4)
    to_bf16(original)
    reference = transformers.Mistral4ForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    compress_checkpoint(original, compressed, chunk_size=64, show_progress=False, say=lambda *_: None)
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    engine = LLMEngine(compressed, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, dtype="float32",
                                                block_size=8, weight_mode="compressed_in_memory"))
    torch.testing.assert_close(engine.prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)


parallel_engines = parallel_engines_fixture("mistral4-parallel", {"mistral4": _mistral4}, Engines)


@pytest.mark.parallel
def test_tp2_ep2_logits_match_transformers_and_the_single_process_engine(parallel_engines):
    # each rank 2 of the 4 heads (scaled by the same positions), half the dense MLP, 4 of the 8 routed experts
    assert_prompt_logits(parallel_engines, "mistral4", (2, 1, 2), (1, 1, 1))


def _raw(**changes) -> dict:
    config = transformers.Mistral4Config(**MISTRAL4).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"rope_parameters": {**YARN, "llama_4_scaling_beta": None}}, CheckpointError,
     "rope_parameters: llama_4_scaling_beta is missing; mistral4 scales"),
    ({"rope_parameters": {**YARN, "llama_4_scaling_beta": -1}}, CheckpointError,
     "llama_4_scaling_beta must be a number >= 0, got -1"),
    ({"rope_parameters": {**YARN, "partial_rotary_factor": 1.0}}, CheckpointError,
     r"partial_rotary_factor must rotate qk_rope_head_dim \(16 of 32 dims: 0.5\), got 1.0"),
    ({"n_group": 3}, CheckpointError, "n_group 3 must split the 8 routed experts into equal groups"),
    ({"topk_group": 5}, CheckpointError, "topk_group 5 exceeds n_group 4"),
    ({"num_experts_per_tok": 5}, CheckpointError, "num_experts_per_tok 5 exceeds the 4 experts of the topk_group 2"),
    ({"num_key_value_heads": 2}, UnsupportedModelError, "num_key_value_heads 2 differs from num_attention_heads 4"),
    ({"attention_bias": True}, UnsupportedModelError, "attention_bias true is not supported"),
    ({"routed_scaling_factor": 0}, CheckpointError, "routed_scaling_factor must be a positive number, got 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 300.0, "llama_4_scaling_beta": 0.1}},
     UnsupportedModelError, r"rope type 'default' is not supported for mistral4 \(supported: yarn\)"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    raw = {"model_type": "mistral4", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "rope_theta": 300.0}
    cfg = parse_config(raw, Path("config.json"))
    # a top-level rope_theta without rope_parameters: transformers' yarn rope all the same, its theta included
    their = transformers.Mistral4Config(**{key: value for key, value in raw.items() if key != "model_type"})
    mla, moe, rope = cfg.mla, cfg.moe, their.rope_parameters
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim,
            mla.rope_interleave) == (their.q_lora_rank, their.kv_lora_rank, their.qk_nope_head_dim,
                                     their.qk_rope_head_dim, their.v_head_dim, their.rope_interleave)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size, moe.num_shared_experts,
            moe.routed_scaling_factor, moe.num_groups, moe.topk_groups, moe.norm_topk_prob) == (
        their.n_routed_experts, their.num_experts_per_tok, their.moe_intermediate_size, their.n_shared_experts,
        their.routed_scaling_factor, their.n_group, their.topk_group, their.norm_topk_prob)
    assert moe.sparse_layers == [i >= their.first_k_dense_replace for i in range(2)]
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == (
        rope["rope_type"], rope["rope_theta"], rope["factor"], rope["original_max_position_embeddings"])
    assert cfg.position_query_scale == (rope["original_max_position_embeddings"], rope["llama_4_scaling_beta"])
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (
        their.max_position_embeddings, their.rms_norm_eps, their.tie_word_embeddings)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (their.bos_token_id, [their.eos_token_id])
    # the image-and-text checkpoint's text model: its text_config defaulted the same
    image_text = parse_config({"model_type": "mistral3", "text_config": raw}, Path("config.json"))
    assert image_text.image_text_checkpoint and image_text.position_query_scale == (8192, 0.1)
