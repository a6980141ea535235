"""DeepSeek-V2, V2-Lite, V2.5 and Coder-V2 checkpoints (`deepseek_v2`): the engine computes what transformers computes
on the same random-weight checkpoint, read from the same config.json.

DeepSeek-V2 is DeepSeek-V3's multi-head latent attention (engine.mla: a latent KV cache; a plain q_proj when
q_lora_rank is null, as in V2-Lite; its rotary dims always interleaved pairs) and shared experts, routed otherwise
(engine.moe.route_grouped): a softmax over the router's logits, no correction bias, weights the chosen scores times
routed_scaling_factor, never renormalized; topk_method `greedy` (V2-Lite) takes the top-k of all experts,
`group_limited_greedy` (V2, V2.5) the top-k of the topk_group groups with the best maximum scores. Two checkpoints:
a Lite-shaped one and a V2-shaped one (compressed query, group-limited routing, one dense layer, yarn rope), whose
routing differs from a plain top-k and from V3's group ranking; prompts chunked and batched beside decode rows, also
at tp=2 + ep=2 and from a compressed copy (the kernel path: tests/kernels/test_deepseek_v2_kernels.py).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from engine.compression.compress import compress_checkpoint
from engine.config import load_config, parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from engine.moe import route_grouped
from tests.engine.conftest import SMALL, YARN
from tests.engine.family_checks import DECODE_PATHS, check_decode_path, parallel_engines_fixture, variant_fixture
from tests.engine.test_compression_checkpoint import to_bf16
from tests.engine.test_mechanics import make_engine
from tests.engine.test_moe import random_prompts
from tests.engine.test_parallel import Engines, assert_prompt_logits

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

# Weights 5x the default scale, so that the attention moves the logits (see conftest's DeepSeek-V3); latent
# attention with values wider than the nope keys; 8 routed experts
BASE = {**SMALL, "num_key_value_heads": 4, "initializer_range": 0.1, "n_routed_experts": 8, "moe_intermediate_size": 32,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 24}
# V2-Lite's shape, small: a plain q_proj, greedy top-2 of all experts, every layer sparse, two shared experts
LITE = {**BASE, "q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 0, "n_shared_experts": 2, "routed_scaling_factor": 1.0}
# V2's: a compressed query, the top-3 of the best 2 of 4 groups (a plain top-3 often spans 3 groups, and ranking the
# groups by their best two, as V3 does, often picks others), one dense layer, one shared expert, scaled weights
V2 = {**BASE, "num_hidden_layers": 3, "q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 4,
      "topk_group": 2, "num_experts_per_tok": 3, "first_k_dense_replace": 1, "n_shared_experts": 1,
      "routed_scaling_factor": 2.0}
# The published configs' spelling: rope_scaling with "type" (V2's yarn as DeepSeek-V3's, conftest's YARN), and the
# keys of DeepSeek's own code that transformers does not read
PUBLISHED = {"scoring_func": "softmax", "moe_layer_freq": 1, "aux_loss_alpha": 0.001, "seq_aux": True}
V2_ROPE = {"rope_scaling": {**{k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")}, "type": "yarn"},
           "rope_theta": 10000.0}


def _deepseek_v2(config: dict):
    return lambda: transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**config))


VARIANTS = {"lite": (_deepseek_v2(LITE), PUBLISHED), "v2": (_deepseek_v2(V2), {**PUBLISHED, **V2_ROPE})}


variant = variant_fixture(VARIANTS, prefix="deepseek-")


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    """Every row of batched chunked prefill and decode steps; the C decode loop declines the latent cache (its values
    are a view of its keys), so both paths attend with the torch op: the second checks that the fallback is whole."""
    check_decode_path(variant, decode_in_c, monkeypatch, "v2",
                      "the decode paths differ in attention only, which one variant covers", needs_c_attention=False)


def test_routing_matches_transformers_router(variant):
    """The same experts and weights as transformers' router for every token, spread and near-tie ones; for V2's
    checkpoint, a plain top-k or V3's group ranking (the sum of a group's best two) would pick other experts."""
    name, directory, reference = variant
    moe = load_config(directory).moe
    gate = reference.model.layers[-1].mlp.gate
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
    if name == "v2":
        plain_topk = dataclasses.replace(moe, num_groups=1, topk_groups=1)
        v3_group_ranking = dataclasses.replace(moe, group_score_experts=2)
        for other in (plain_topk, v3_group_ranking):
            other_ids = route_grouped(x, gate.weight, None, other)[1]
            assert (other_ids.sort().values != ids.sort().values).any(dim=-1).sum() > 5


def test_config_reads_as_transformers_reads_it(variant):
    """The latent cache's geometry and the GetModelInfo KV bytes per token it makes (kv_lora_rank + qk_rope_head_dim
    per layer, in the engine's dtype), yarn's scales, the dense and sparse layers, and memory sizing counting every
    parameter."""
    from engine.demo import train_tokenizer
    from engine.model import mla_softmax_scale
    from node_agent.models import _model_info

    name, directory, reference = variant
    cfg, their = load_config(directory), reference.config
    assert (cfg.mla.q_lora_rank, cfg.mla.rope_interleave) == (their.q_lora_rank, True)
    assert cfg.moe.sparse_layers == [i >= their.first_k_dense_replace for i in range(their.num_hidden_layers)]
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())
    attention = reference.model.layers[0].self_attn
    assert mla_softmax_scale(cfg) == pytest.approx(attention.scaling)
    assert cfg.rope.attention_factor == pytest.approx(reference.model.rotary_emb.attention_scaling)
    if name != "v2":
        return
    assert cfg.rope.rope_type == "yarn" and attention.scaling != pytest.approx(their.qk_head_dim ** -0.5)
    train_tokenizer(320).save(str(directory / "tokenizer.json"))   # GetModelInfo sends it
    latent = their.kv_lora_rank + their.qk_rope_head_dim
    assert _model_info("ds", make_engine(directory)).kv_bytes_per_token == their.num_hidden_layers * latent * 4
    assert _model_info("ds", make_engine(directory, dtype="bfloat16")).kv_bytes_per_token == 3 * latent * 2


def test_a_compressed_copy_gives_the_logits_of_its_original(variant, tmp_path):
    name, directory, _ = variant
    if name != "v2":
        pytest.skip("one variant covers the compressed copy")
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    shutil.copytree(directory, original)
    to_bf16(original)
    compress_checkpoint(original, compressed, chunk_size=64, show_progress=False, say=lambda *_: None)
    prompt = random_prompts([20], seed=5)[0]
    plain = make_engine(original, dtype="float32").prompt_logits(prompt)
    for mode in ("decompress_on_load", "compressed_in_memory"):
        engine = LLMEngine(compressed, EngineConfig(kv_cache_bytes=8 << 20, show_progress=False, dtype="float32",
                                                    block_size=8, weight_mode=mode))
        assert torch.equal(engine.prompt_logits(prompt), plain), mode


parallel_engines = parallel_engines_fixture("deepseek-v2-parallel", {"v2": VARIANTS["v2"][0]}, Engines)


@pytest.mark.parallel
def test_tp2_ep2_logits_match_transformers_and_the_single_process_engine(parallel_engines):
    # each rank 2 of the 4 heads (their q_b_proj, kv_b_proj and o_proj parts; the latent projections whole), half the
    # dense MLP, 4 of the 8 routed experts and the whole shared expert
    assert_prompt_logits(parallel_engines, "v2", (2, 1, 2), (1, 1, 1))


def _raw(**changes) -> dict:
    config = transformers.DeepseekV2Config(**V2).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"topk_method": "noaux_tc"}, UnsupportedModelError,
     "topk_method 'noaux_tc' is not supported for deepseek_v2 (supported: greedy, group_limited_greedy)"),
    ({"n_group": 3}, CheckpointError, "n_group 3 must split the 8 routed experts into equal groups"),
    ({"topk_group": 5}, CheckpointError, "topk_group 5 exceeds n_group 4"),
    ({"n_group": None}, CheckpointError, "missing required field 'n_group'"),
    ({"num_experts_per_tok": 5}, CheckpointError, "num_experts_per_tok 5 exceeds the 4 experts of the topk_group 2"),
    ({"scoring_func": "sigmoid"}, UnsupportedModelError, "scoring_func 'sigmoid' is not supported (only DeepSeek-V2's"),
    ({"moe_layer_freq": 2}, UnsupportedModelError, "moe_layer_freq 2 is not supported"),
    ({"norm_topk_prob": True}, UnsupportedModelError, "norm_topk_prob true is not supported for deepseek_v2"),
    ({"mlp_bias": True}, UnsupportedModelError, "mlp_bias true is not supported for deepseek_v2"),
    ({"attention_bias": True}, UnsupportedModelError, "attention_bias true is not supported"),
    ({"num_key_value_heads": 2}, UnsupportedModelError, "num_key_value_heads 2 differs from num_attention_heads 4"),
    ({"routed_scaling_factor": 0}, CheckpointError, "routed_scaling_factor must be a positive number, got 0"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, UnsupportedModelError,
     "rope type 'dynamic' is not supported for deepseek_v2 (supported: default, yarn)"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    escaped = message.replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(error, match=escaped):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    raw = {"model_type": "deepseek_v2", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_experts_per_tok": 2}
    cfg = parse_config(raw, Path("config.json"))
    their = transformers.DeepseekV2Config(**{key: value for key, value in raw.items() if key != "model_type"})
    mla, moe = cfg.mla, cfg.moe
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        their.q_lora_rank, their.kv_lora_rank, their.qk_nope_head_dim, their.qk_rope_head_dim, their.v_head_dim)
    assert (moe.num_experts, moe.intermediate_size, moe.num_shared_experts, moe.routed_scaling_factor) == (
        their.n_routed_experts, their.moe_intermediate_size, their.n_shared_experts, their.routed_scaling_factor)
    assert (moe.num_groups, moe.topk_groups, moe.norm_topk_prob) == (1, 1, False) and their.topk_method == "greedy"
    assert moe.sparse_layers == [i >= their.first_k_dense_replace for i in range(2)]
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.rope.theta) == (
        their.max_position_embeddings, their.rms_norm_eps, their.rope_parameters["rope_theta"])
    # generation stops at transformers' eos (2) where neither config.json nor generation_config.json names one
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (their.bos_token_id, [their.eos_token_id]) == (1, [2])
