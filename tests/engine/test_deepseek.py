"""DeepSeek-V3 (multi-head latent attention, grouped routing, shared experts): its latent-only KV cache
through the engine's mechanics (prefix cache, preemption, KV export/import, bytes per token), its
routing against transformers' router, and the checkpoints it refuses. Logits of batched chunked runs
against transformers: tests/engine/test_moe.py; expert and tensor parallelism: test_parallel_moe.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import load_config, parse_config
from engine.errors import CheckpointError, UnsupportedModelError
from engine.moe import route_grouped
from tests.engine.conftest import YARN, build_checkpoint
from tests.engine.test_mechanics import (GREEDY, assert_a_small_pool_gives_the_plain_tokens, assert_no_leak,
                                         make_engine, moved, prompt, run)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek-v3")
    return directory, build_checkpoint(directory, "deepseek-v3")


def test_the_cache_holds_one_latent_per_token_and_reports_its_bytes(deepseek):
    """Per token and layer: kv_lora_rank + qk_rope_head_dim values (32 + 16), not num_heads x (key +
    value) dims; GetModelInfo reports that, in the engine's dtype."""
    from engine.demo import train_tokenizer
    from node_agent.models import _model_info

    directory, model = deepseek
    train_tokenizer(320).save(str(directory / "tokenizer.json"))   # GetModelInfo sends it
    cfg = model.config
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    engine = make_engine(directory)
    assert tuple(engine.executor.kv_cache.shape) == (3, 1, engine.block_manager.num_blocks, 8, 1, latent)
    assert _model_info("ds", engine).kv_bytes_per_token == 3 * latent * 4 == 576
    halves = make_engine(directory, dtype="bfloat16")
    assert _model_info("ds", halves).kv_bytes_per_token == 3 * latent * 2
    decompressed = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    assert latent < decompressed


def test_prefix_cache_and_preemption_give_the_plain_tokens(deepseek):
    directory, _ = deepseek
    # 24 blocks of 8 tokens: 3 layers of 48-value latents
    assert_a_small_pool_gives_the_plain_tokens(directory, kv_cache_bytes=24 * 3 * 8 * 48 * 4)


def test_exported_latents_imported_elsewhere_give_the_colocated_tokens(deepseek):
    directory, _ = deepseek
    p = prompt(45, seed=40)
    plain = run(make_engine(directory), {"a": (p, GREEDY)})["a"]
    source, target = make_engine(directory), make_engine(directory, block_size=16)
    tokens, payload = moved(source, target, "a", p, GREEDY)
    layout = payload.layout
    assert (layout.kv_parts, layout.num_kv_heads, layout.head_dim) == (1, 1, 48)
    assert payload.num_bytes == 3 * 45 * 48 * 4
    assert tokens == plain
    assert_no_leak(source)
    assert_no_leak(target)


def test_grouped_routing_matches_transformers_router(deepseek):
    """The same experts and weights as transformers' router, for tokens whose group and expert choices
    are near ties as well as spread ones; the choice never leaves the token's best topk_group groups."""
    directory, model = deepseek
    gate = model.model.layers[1].mlp.gate
    moe = load_config(directory).moe
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(300, 64, generator=generator), torch.zeros(4, 64)])
    with torch.no_grad():
        _, their_weights, their_ids = gate(x)
    weights, ids = route_grouped(x, gate.weight, gate.e_score_correction_bias, moe)
    for row in range(x.shape[0]):   # slot order is free (the reference leaves its top-k unsorted)
        mine = sorted(zip(ids[row].tolist(), weights[row].tolist()))
        ref = sorted(zip(their_ids[row].tolist(), their_weights[row].tolist()))
        assert [e for e, _ in mine] == [e for e, _ in ref], row
        torch.testing.assert_close(torch.tensor([w for _, w in mine]), torch.tensor([w for _, w in ref]))
    groups = (ids // (moe.num_experts // moe.num_groups))
    assert all(len(set(row)) <= moe.topk_groups for row in groups.tolist())


RAW = {"model_type": "deepseek_v3", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
       "num_hidden_layers": 2, "num_attention_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 16, "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
       "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}


@pytest.mark.parametrize("change,error,message", [
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, UnsupportedModelError,
     r"rope type 'dynamic' is not supported for deepseek_v3 \(supported: default, yarn\)"),
    ({"scoring_func": "softmax"}, UnsupportedModelError, r"scoring_func 'softmax' is not supported"),
    ({"topk_method": "greedy"}, UnsupportedModelError, r"topk_method 'greedy' is not supported"),
    ({"attention_bias": True}, UnsupportedModelError, "attention_bias true is not supported"),
    ({"num_key_value_heads": 2}, UnsupportedModelError, "num_key_value_heads 2 differs from num_attention_heads 4"),
    ({"n_group": 3}, CheckpointError, "n_group 3 must split the 8 routed experts into equal groups"),
    ({"topk_group": 5}, CheckpointError, "topk_group 5 exceeds n_group 4"),
    ({"num_experts_per_tok": 5}, CheckpointError, "num_experts_per_tok 5 exceeds the 4 experts"),
    ({"kv_lora_rank": None}, CheckpointError, "missing required field 'kv_lora_rank'"),
    ({"qk_rope_head_dim": 7}, CheckpointError, "qk_rope_head_dim must be even"),
    # yarn's fields: a string is not read as a number (float("4") would take it, float("4x") raise bare)
    ({"rope_scaling": {**YARN, "factor": "4"}}, CheckpointError,
     "config.json: factor must be a positive number, got '4'"),
    ({"rope_scaling": {**YARN, "beta_fast": "32x"}}, CheckpointError, "beta_fast must be a positive number, got '32x'"),
    ({"rope_scaling": {**YARN, "original_max_position_embeddings": "128"}}, CheckpointError,
     "original_max_position_embeddings must be a positive integer, got '128'"),
    ({"rope_scaling": {**YARN, "mscale_all_dim": "0.7"}}, CheckpointError, "mscale_all_dim must be a number >= 0"),
    ({"rope_scaling": {**YARN, "mscale": -1}}, CheckpointError, "mscale must be a number >= 0, got -1"),
    ({"rope_scaling": {**YARN, "attention_factor": [1.0]}}, CheckpointError,
     "attention_factor must be a positive number"),
    ({"rope_scaling": {**YARN, "truncate": "false"}}, CheckpointError, "truncate must be true or false, got 'false'"),
    # no factor: the ratio of max_position_embeddings to the original, which must then be given
    ({"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 128}}, CheckpointError,
     "missing required field 'max_position_embeddings'"),
])
def test_unsupported_or_bad_config_is_refused_with_what_to_fix(tmp_path, change, error, message):
    with pytest.raises(error, match=message):
        parse_config({**RAW, **change}, tmp_path / "config.json")


def test_a_checkpoint_with_an_unsupported_rope_is_refused_at_load(tmp_path):
    from engine.engine import EngineConfig, LLMEngine

    build_checkpoint(tmp_path, "deepseek-v3")
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    path.write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="rope type 'longrope' is not supported"):
        LLMEngine(tmp_path, EngineConfig(show_progress=False))
