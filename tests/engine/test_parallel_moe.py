"""Expert-parallel engines (gloo, CPU): a mixture of experts' experts split across the ranks of a
stage compute what the single-process engine computes.

Layouts: ep=2 with attention repeated on both ranks (tp=1), ep=2 inside tp=2 (the experts split
across the TP ranks), and ep=2 on each of 2 pipeline stages. Checkpoints: a Qwen3-MoE with a dense
layer between its two sparse ones, a Mixtral whose first layer's router is zero, so every token
of every batch goes to the same two experts there (the most uneven load a step can have; the
second layer routes normally), and a DeepSeek-V3 (latent attention whose cache is replicated on
the TP ranks while its query heads are split, grouped routing, a shared expert on every rank).
Each (checkpoint, layout) engine starts once per module and serves every check: logits against transformers and the single-process engine, every row of a batched
chunked greedy run against transformers, the workload of test_parallel (chunked prefill, a
prefix-cache hit, a preemption, seeded sampling, an abort), and KV moved between single-device
and expert-parallel engines in both directions. Run them alone with `pytest -m parallel`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine import LLMEngine
from engine.memory import rank_parameters
from engine.moe import route
from engine.sampling import SamplingParams
from tests.engine.conftest import YARN, _deepseek_v3, _mixtral, _qwen3_moe
from tests.engine.test_moe import recorded_rows
from tests.engine.test_parallel import Engines as ParallelEngines
from tests.engine.test_parallel import _workload, assert_prompt_logits, assert_workload, moves_between

pytestmark = pytest.mark.parallel

SINGLE = (1, 1, 1)   # (tp, pp, ep)
CASES = [("mixtral-skewed", (1, 1, 2)), ("qwen3-moe", (1, 1, 2)), ("qwen3-moe", (2, 1, 2)), ("qwen3-moe", (1, 2, 2)),
         ("deepseek-v3", (1, 1, 2)), ("deepseek-v3", (2, 1, 2)), ("deepseek-v3", (1, 2, 2))]
IDS = [f"{name}-tp{t}pp{p}ep{e}" for name, (t, p, e) in CASES]
# layouts whose rank 0 computes every logit (tp=1, one stage): each computed row can be read there
ROW_CASES = [(name, layout) for name, layout in CASES if layout[:2] == (1, 1)]


CHECKPOINTS = {"mixtral-skewed": _mixtral, "qwen3-moe": _qwen3_moe,
               "deepseek-v3": lambda: _deepseek_v3(q_lora_rank=24, rope_parameters=YARN)}


class Engines(ParallelEngines):
    """test_parallel's engines on these checkpoints; layouts are (tp, pp, ep)."""

    def __init__(self, root: Path):
        super().__init__(root, CHECKPOINTS)

    def adjust(self, name: str, model: torch.nn.Module) -> None:
        if name == "mixtral-skewed":
            with torch.no_grad():   # equal router logits: every token picks the same two experts
                model.model.layers[0].mlp.gate.weight.zero_()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    made = Engines(tmp_path_factory.mktemp("parallel-moe"))
    yield made
    made.close()


@pytest.mark.parametrize("name, layout", CASES, ids=IDS)
def test_logits_match_transformers_and_the_single_process_engine(engines, name, layout):
    assert_prompt_logits(engines, name, layout, SINGLE)


def test_each_rank_holds_its_experts_and_the_skewed_layer_sends_every_token_to_one_pair(engines):
    engine = engines.get("mixtral-skewed", (1, 1, 2))
    layers = engine.model.weights.layers
    assert [layer.moe.gate_up.shape[0] for layer in layers] == [2, 2]   # experts 0-1 of 4 on rank 0
    # what memory sizing counts for rank 0 is what rank 0 loaded
    assert rank_parameters(engine.model_config, engine.layout)[0] == _elements(engine.model.weights)
    # layer 0: one pair of experts for every token; layer 1: spread over all four
    hidden = torch.randn(200, engine.model_config.hidden_size, generator=torch.Generator().manual_seed(0))
    _, skewed = route(hidden, layers[0].moe.router, 2, True)
    _, spread = route(hidden, layers[1].moe.router, 2, True)
    assert (skewed == skewed[0]).all()
    assert set(spread.flatten().tolist()) == {0, 1, 2, 3}


def _elements(weights) -> int:
    tensors = {id(t): t for t in (weights.embed_tokens, weights.norm, weights.lm_head) if t is not None}
    for layer in weights.layers:
        held = [layer.input_norm, layer.qkv, layer.qkv_bias, layer.q_norm, layer.k_norm, layer.o_proj,
                layer.post_norm, layer.gate_up, layer.down]
        if layer.moe is not None:
            moe = layer.moe
            held += [moe.router, moe.gate_up, moe.down, moe.correction_bias, moe.shared_gate_up, moe.shared_down]
        if layer.mla is not None:
            mla = layer.mla
            held += [mla.q_proj, mla.q_a_proj, mla.q_a_norm, mla.q_b_proj, mla.kv_a_proj, mla.kv_a_norm, mla.k_up,
                     mla.v_up, mla.o_proj]
        tensors |= {id(t): t for t in held if t is not None}
    return sum(t.numel() for t in tensors.values())


def test_deepseek_ranks_hold_their_heads_and_experts_and_the_whole_latent(engines):
    """tp=2 + ep=2: each rank decompresses the latent for half the query heads, holds half the routed
    experts and the whole shared expert, and caches the whole latent (one 'KV head', replicated);
    memory sizing counts what it loaded."""
    engine = engines.get("deepseek-v3", (2, 1, 2))
    layers = engine.model.weights.layers
    assert [layer.mla.k_up.shape[0] for layer in layers] == [2, 2, 2]      # of 4 heads
    assert [layer.moe.gate_up.shape[0] for layer in layers[1:]] == [4, 4]  # of 8 routed experts
    assert layers[1].moe.shared_down.shape == (64, 32)
    assert rank_parameters(engine.model_config, engine.layout)[0] == _elements(engine.model.weights)
    assert [len(s) for s in engine.kv_map.read] == [1] * 3 and [len(s) for s in engine.kv_map.write] == [2] * 3
    assert tuple(engine.executor.shard.kv_cache.shape[-2:]) == (1, 32 + 16)


def _greedy_with_rows(engine: LLMEngine, prompts: list[list[int]], max_tokens: int):
    """Greedy outputs of a batch that arrives in two halves, and rank 0's logits of every row computed."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    with recorded_rows(engine) as logits:
        for i in range(0, len(prompts), 2):
            engine.add_request(f"row-{i}", prompts[i], params)
        for _ in range(3):
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out.token.token_id)
        for i in range(1, len(prompts), 2):
            engine.add_request(f"row-{i}", prompts[i], params)
        while engine.has_work():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out.token.token_id)
    return [outputs[f"row-{i}"] for i in range(len(prompts))], logits


@pytest.mark.parametrize("name, layout", ROW_CASES, ids=[f"{n}-ep{layout[2]}" for n, layout in ROW_CASES])
def test_batched_chunked_rows_match_transformers_and_tokens_match_ep1(engines, name, layout):
    """Requests batched with chunked prefill (24-token budget): every row's logits within 1e-4 of
    transformers, and the greedy tokens those of the single-process engine and of transformers."""
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 320, (n,), generator=generator).tolist() for n in (3, 9, 17, 31, 26, 5)]
    ours, logits = _greedy_with_rows(engines.get(name, layout), prompts, max_tokens=8)
    single, _ = _greedy_with_rows(engines.get(name, SINGLE), prompts, max_tokens=8)
    assert ours == single
    for i, (p, tokens) in enumerate(zip(prompts, ours)):
        full = p + tokens[:-1]
        with torch.no_grad():
            theirs = engines.references[name](torch.tensor([full])).logits[0].float()
        torch.testing.assert_close(torch.stack([logits[(f"row-{i}", pos)] for pos in range(len(full))]), theirs,
                                   rtol=1e-4, atol=1e-4)
        # transformers' greedy pick after each prefix is our token: its greedy run is ours
        assert theirs[len(p) - 1:].argmax(-1).tolist() == tokens


@pytest.fixture(scope="module")
def reference_runs(engines):
    """The single-process engine's workload, per checkpoint."""
    return {name: _workload(engines.get(name, SINGLE)) for name in CHECKPOINTS}


@pytest.mark.parametrize("name, layout", CASES, ids=IDS)
def test_workload_tokens_equal_the_single_process_engine(engines, reference_runs, name, layout):
    assert_workload(engines.get(name, layout), reference_runs[name])


def test_kv_moves_between_single_device_and_expert_parallel_engines(engines):
    """Prefill on one engine, export (canonical: every layer, every KV head), import on the other,
    decode: the tokens of a colocated single-device run, both ways and between EP layouts. Ranks that
    repeat attention hold the same KV: an export reads it once, an import writes every copy."""
    replicated = engines.get("qwen3-moe", (1, 1, 2))
    assert [len(s) for s in replicated.kv_map.read] == [1] * 3 and [len(s) for s in replicated.kv_map.write] == [2] * 3
    pairs = [(SINGLE, (1, 1, 2)), ((1, 1, 2), SINGLE), ((2, 1, 2), (1, 2, 2)), ((1, 2, 2), (2, 1, 2)),
             (SINGLE, (2, 1, 2))]
    for request, tokens, expected, payload in moves_between(engines, "qwen3-moe", SINGLE, pairs, seed=11):
        assert (payload.layout.num_layers, payload.layout.num_kv_heads) == (3, 2)
        assert tokens == expected, request
    for _, layout in CASES[1:]:
        pool = engines.get("qwen3-moe", layout).block_manager
        assert pool.num_free_blocks == pool.num_blocks


def test_deepseek_latents_move_between_single_device_and_parallel_engines(engines):
    """The latent cache exported from one layout and imported into another: the colocated tokens."""
    pairs = [(SINGLE, (2, 1, 2)), ((2, 1, 2), (1, 2, 2)), ((1, 2, 2), (1, 1, 2)), ((1, 1, 2), SINGLE)]
    for request, tokens, expected, payload in moves_between(engines, "deepseek-v3", SINGLE, pairs, seed=12):
        assert (payload.layout.num_layers, payload.layout.kv_parts, payload.layout.num_kv_heads) == (3, 1, 1)
        assert tokens == expected, request
