"""Mixture-of-experts checkpoints (Mixtral, Qwen3-MoE, DeepSeek-V3) against transformers, and the
engine's mechanics (prefix cache, preemption, KV export/import, seeded sampling) on them (DeepSeek-V3's
latent KV cache: tests/engine/test_deepseek.py).

Logits are compared row by row for every token the engine computed while it batched requests
with chunked prefill, so decode rows and prefill chunks of different requests sharing a step
are all checked, not only a lone prompt.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from engine import ops
from engine.engine import EngineConfig, LLMEngine
from engine.moe import route
from engine.sampling import SamplingParams
from tests.engine.conftest import build_checkpoint
from tests.engine.test_mechanics import (GREEDY, assert_a_small_pool_gives_the_plain_tokens, assert_no_leak,
                                         make_engine, moved, prompt, run)
from tests.engine.test_reference import engine_greedy

LENGTHS = [3, 9, 17, 31, 48, 70, 5, 26]


@pytest.fixture(scope="module", params=["mixtral", "qwen3-moe", "deepseek-v3", "deepseek-v3-qlora"])
def moe_checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return directory, build_checkpoint(directory, request.param)


@pytest.fixture(scope="module")
def one_expert_checkpoint(tmp_path_factory):
    """A Mixtral whose routers are all zero: every token has the same top-2 experts, the rest get none."""
    directory = tmp_path_factory.mktemp("mixtral-imbalanced")
    model = build_checkpoint(directory, "mixtral")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
    model.save_pretrained(directory)
    return directory, model


@contextlib.contextmanager
def recorded_rows(engine: LLMEngine):
    """While inside: the logits of every row the engine computes (on rank 0), by (request, position)."""
    shard = engine.executor if engine.layout.world_size == 1 else engine.executor.shard
    logits: dict[tuple[str, int], torch.Tensor] = {}
    forward = shard.forward

    def recording_forward(inputs, hidden_in=None):
        hidden = forward(inputs, hidden_in)
        rows = engine.model.compute_logits(hidden)
        for i, item in enumerate(inputs.order):
            start = item.seq.num_computed_tokens
            for offset, row in enumerate(range(inputs.batch.query_start[i], inputs.batch.query_start[i + 1])):
                logits[(item.seq.request_id, start + offset)] = rows[row]
        return hidden

    shard.forward = recording_forward
    try:
        yield logits
    finally:
        del shard.forward


def greedy_with_logits(engine: LLMEngine, prompts: list[list[int]], max_tokens: int):
    """Greedy outputs per request and the logits of every row the engine computed, by (request, position)."""
    with recorded_rows(engine) as logits:
        outputs = engine_greedy(engine, prompts, max_tokens)
    return outputs, logits


def check_against_transformers(directory, model, prompts: list[list[int]], max_tokens: int) -> None:
    # A 24-token budget splits the longer prompts into chunks that share steps with decodes.
    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=8 << 20, show_progress=False,
                                               max_num_batched_tokens=24, block_size=8))
    ours, logits = greedy_with_logits(engine, prompts, max_tokens)
    for i, (p, tokens) in enumerate(zip(prompts, ours)):
        full = p + tokens[:-1]
        with torch.no_grad():
            theirs = model(torch.tensor([full])).logits[0].float()
        ours_rows = torch.stack([logits[(str(i), pos)] for pos in range(len(full))])
        torch.testing.assert_close(ours_rows, theirs, rtol=1e-4, atol=1e-4)
        # transformers' greedy pick after each prefix is our token, so by induction its greedy
        # generation from the prompt is our output (one forward instead of max_tokens of them).
        assert theirs[len(p) - 1:].argmax(-1).tolist() == tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (n,), generator=generator).tolist() for n in lengths]


def test_batched_chunked_logits_and_greedy_match_transformers(moe_checkpoint):
    directory, model = moe_checkpoint
    check_against_transformers(directory, model, random_prompts(LENGTHS, seed=7), max_tokens=10)


def test_every_token_routed_to_the_same_experts(one_expert_checkpoint):
    directory, model = one_expert_checkpoint
    engine = make_engine(directory)
    router = engine.model.weights.layers[0].moe.router
    _, ids = route(torch.randn(50, router.shape[1]), router, 2, True)
    assert (ids == ids[0]).all(), "the zero router should send every token to one pair of experts"
    check_against_transformers(directory, model, random_prompts(LENGTHS[:5], seed=8), max_tokens=6)


def test_fused_moe_with_all_tokens_on_one_expert_matches_per_token_loop():
    torch.manual_seed(0)
    x = torch.randn(37, 16)
    gate_up, down = torch.randn(4, 2 * 24, 16) * 0.3, torch.randn(4, 16, 24) * 0.3
    cases = {"one expert": torch.full((37, 1), 2), "one pair": torch.tensor([[3, 0]]).repeat(37, 1),
             "spread": torch.randint(0, 4, (37, 1))}
    for name, ids in cases.items():
        weights = torch.rand(ids.shape)
        expected = torch.stack([
            sum(w * (ops.silu_and_mul(x[t] @ gate_up[e].T) @ down[e].T) for w, e in zip(weights[t], ids[t].tolist()))
            for t in range(37)])
        torch.testing.assert_close(ops.fused_moe(x, weights, ids, gate_up, down), expected, msg=name)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3-moe-mechanics")
    build_checkpoint(directory, "qwen3-moe")
    return directory


def test_prefix_cache_and_preemption_give_the_plain_tokens(qwen3_moe):
    # 24 blocks of 8 tokens: 3 layers of keys and values, 2 KV heads of 16
    assert_a_small_pool_gives_the_plain_tokens(qwen3_moe, kv_cache_bytes=24 * 3 * 2 * 8 * 2 * 16 * 4)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)])
def test_export_import_and_seeded_sampling(qwen3_moe, params):
    p = prompt(45, seed=40)
    others = {f"o{i}": (prompt(10 + i, seed=30 + i), SamplingParams(max_tokens=6, temperature=1.0)) for i in range(3)}
    plain = run(make_engine(qwen3_moe), {"a": (p, params)})["a"]
    assert run(make_engine(qwen3_moe), {**others, "a": (p, params)})["a"] == plain
    source, target = make_engine(qwen3_moe), make_engine(qwen3_moe, block_size=16)
    assert moved(source, target, "a", p, params)[0] == plain
    assert_no_leak(source)
    assert_no_leak(target)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe", "deepseek-v3"])
def test_demo_checkpoint_loads_in_transformers_and_the_engine_alike(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    from deploy.cli import main

    assert main(["make-demo-model", str(tmp_path), "--size", "tiny", "--arch", arch]) == 0
    engine = make_engine(tmp_path)
    assert engine.model_config.moe is not None
    assert [layer.moe is not None for layer in engine.model.weights.layers] == engine.model_config.moe.sparse_layers
    # What routers place with (GetModelInfo): the attention KV only; experts hold no KV. DeepSeek-V3's
    # cache holds one latent per token and layer (kv_lora_rank + qk_rope_head_dim), not keys and values.
    from node_agent.models import _model_info
    mc, raw = engine.model_config, json.loads((tmp_path / "config.json").read_text())
    per_layer = (raw["kv_lora_rank"] + raw["qk_rope_head_dim"] if arch == "deepseek-v3"
                 else 2 * raw["num_key_value_heads"] * raw["head_dim"])
    assert _model_info("demo", engine).kv_bytes_per_token == mc.num_layers * per_layer * 4
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    p = prompt(30, seed=5)
    with torch.no_grad():
        theirs = reference(torch.tensor([p])).logits[0]
    torch.testing.assert_close(engine.prompt_logits(p), theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe", "qwen3-moe-step2", "qwen3-tied", "qwen2", "deepseek-v3",
                                  "deepseek-v3-qlora"])
def test_resident_weight_count_is_every_parameter_transformers_builds(tmp_path, arch):
    """Memory sizing counts every expert of every layer (all are resident), the dense layers among them
    at their own width, tied embeddings once, and DeepSeek-V3's shared experts, latent attention and
    routing bias (a buffer in transformers, a checkpoint tensor all the same)."""
    from engine.config import load_config

    model = build_checkpoint(tmp_path, arch)
    bias = sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    assert load_config(tmp_path).num_parameters() == sum(p.numel() for p in model.parameters()) + bias


def test_a_model_too_large_for_memory_is_refused_before_loading(tmp_path):
    """A Mixtral with DeepSeek-V3's expert count and widths: ~0.7T parameters, all resident, fit no host in float32."""
    import json

    from transformers import MixtralConfig

    from engine.errors import InsufficientMemoryError

    config = MixtralConfig(vocab_size=129280, hidden_size=7168, intermediate_size=2048, num_hidden_layers=61,
                           num_attention_heads=56, num_key_value_heads=8, num_local_experts=256, num_experts_per_tok=8)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(InsufficientMemoryError, match=r"GiB of weights, all 256 experts of its 61 MoE layers resident"):
        LLMEngine(tmp_path, EngineConfig(device="cpu", dtype="float32", show_progress=False))


@pytest.mark.parametrize("change,message", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds the 8 experts"),
    ({"num_local_experts": 0}, "num_local_experts must be a positive integer"),
    ({"model_type": "qwen3_moe", "moe_intermediate_size": 8, "mlp_only_layers": [5]}, r"mlp_only_layers must list"),
    ({"model_type": "qwen3_moe"}, "missing required field 'moe_intermediate_size'"),
])
def test_bad_moe_config_is_refused_with_what_to_fix(tmp_path, change, message):
    from engine.config import parse_config
    from engine.errors import CheckpointError

    raw = {"model_type": "mixtral", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 2}
    with pytest.raises(CheckpointError, match=message):
        parse_config({**raw, **change}, tmp_path / "config.json")
