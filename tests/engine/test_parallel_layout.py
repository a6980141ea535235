"""What each rank of a tensor/pipeline/expert-parallel engine holds: pure functions, no processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import parse_config
from engine.memory import rank_parameters
from engine.parallel.kv_pool import build_kv_map
from engine.parallel.layout import ParallelLayout, layer_cost, rank_shard, split_layers

LLAMA_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)


def config(**changes):
    return parse_config({**LLAMA_8B, **changes}, Path("config.json"))


def test_stages_balance_the_lm_head_against_layers():
    """Llama-3-8B's LM head reads as many weights as 2.4 layers: the last of 2 stages takes 2 layers fewer."""
    assert [len(r) for r in split_layers(config(), 2)] == [17, 15]
    assert [len(r) for r in split_layers(config(), 4)] == [8, 9, 9, 6]
    assert [len(r) for r in split_layers(config(vocab_size=256), 2)] == [16, 16]  # a tiny head: equal counts
    stages = split_layers(config(), 8)
    assert [r.start for r in stages[1:]] == [r.stop for r in stages[:-1]] and stages[-1].stop == 32


def test_a_mixture_of_experts_layer_weighs_its_experts():
    moe = config(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4096,
                 num_hidden_layers=8, mlp_only_layers=[0, 1, 2, 3], vocab_size=256)
    # layers 4-7 hold 8 experts each (twice a dense layer's weights): the dense half and one sparse layer
    # make the first stage
    assert [len(r) for r in split_layers(moe, 2)] == [5, 3]


@pytest.mark.parametrize("changes", [
    dict(model_type="qwen2"),                          # q/k/v biases
    dict(model_type="qwen3", head_dim=128),            # q/k norms
    dict(model_type="deepseek_v3", num_key_value_heads=32, n_routed_experts=8, num_experts_per_tok=2,
         moe_intermediate_size=512, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
         kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    # (latent attention, and the routing correction bias)
])
def test_the_stage_split_weighs_a_layer_as_the_memory_check_counts_it(changes):
    cfg = config(**changes)
    embedding_head_and_norm = 2 * cfg.vocab_size * cfg.hidden_size + cfg.hidden_size
    layers = sum(layer_cost(cfg, layer) for layer in range(cfg.num_layers))
    assert layers + embedding_head_and_norm == rank_parameters(cfg, ParallelLayout())[0]


def test_tp_splits_heads_and_replicates_kv_heads_below_tp():
    mqa = config(num_key_value_heads=2)
    shards = [rank_shard(ParallelLayout(4, 1), mqa, rank, split_layers(mqa, 1)) for rank in range(4)]
    assert [list(s.kv_heads) for s in shards] == [[0], [0], [1], [1]]
    assert [(s.heads.start, s.heads.stop) for s in shards] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    # a rank's query heads all use its KV head: heads 8-15 group with KV head 0 (32 / 2 = 16 per group)
    assert [s.vocab.stop - s.vocab.start for s in shards] == [32064] * 4


@pytest.mark.parametrize("tp, pp, message", [
    (3, 1, "does not divide the model's 32 attention heads; use one of [1, 2, 4, 8, 16, 32]"),
    (1, 33, "exceeds the model's 32 layers"),
])
def test_layouts_the_model_cannot_take_are_refused(tp, pp, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ParallelLayout(tp, pp).check_model(config())


def test_tp_is_refused_for_experts_and_bad_sizes_are_refused():
    moe = config(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="does not split a mixture-of-experts model's experts; set "
                                         "expert_parallel_size 2 as well"):
        ParallelLayout(2, 1).check_model(moe)
    ParallelLayout(1, 2).check_model(moe)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        ParallelLayout(0, 1).validate()


def test_kv_map_reads_each_head_once_and_writes_every_replica():
    cfg = config(num_hidden_layers=4, num_key_value_heads=2)
    layout = ParallelLayout(4, 2)
    stages = split_layers(cfg, 2)
    shards = [rank_shard(layout, cfg, rank, stages) for rank in range(8)]
    pools = [torch.zeros(len(s.layers), 2, 1, 1, len(s.kv_heads), 1) for s in shards]
    kv_map = build_kv_map(shards, pools, 4)
    for layer in range(4):
        assert [list(p.heads) for p in kv_map.read[layer]] == [[0], [1]]
        assert len(kv_map.write[layer]) == 4  # 4 TP ranks of the layer's stage
        stage_ranks = [r for r, s in enumerate(shards) if layer in s.layers]
        assert {id(p.pool) for p in kv_map.write[layer]} == {id(pools[r]) for r in stage_ranks}


MIXTRAL = dict(LLAMA_8B, model_type="mixtral", vocab_size=32000, num_local_experts=8, num_experts_per_tok=2)


def shards_of(layout: ParallelLayout, cfg) -> list:
    return [rank_shard(layout, cfg, rank, layout.stages(cfg)) for rank in range(layout.world_size)]


def test_experts_split_in_runs_with_attention_repeated_or_tensor_parallel():
    moe = config(**MIXTRAL)
    # tp=1, ep=2: both ranks hold every head and KV head and half the experts; rank 1 computes no logits
    repeated = shards_of(ParallelLayout(1, 1, 2), moe)
    assert [(s.experts, s.heads, s.kv_heads, s.vocab) for s in repeated] == [
        (range(0, 4), range(32), range(8), range(32000)), (range(4, 8), range(32), range(8), range(32000))]
    assert [(s.is_replica, s.computes_logits) for s in repeated] == [(False, True), (True, False)]
    # tp=2, ep=2: the experts split across the TP ranks, which split the heads and vocabulary as under TP
    split = shards_of(ParallelLayout(2, 1, 2), moe)
    assert [(s.experts, s.heads, s.kv_heads, s.vocab) for s in split] == [
        (range(0, 4), range(0, 16), range(0, 4), range(0, 16000)),
        (range(4, 8), range(16, 32), range(4, 8), range(16000, 32000))]
    assert all(s.computes_logits for s in split)
    # ep=2 on each of 2 stages: 4 ranks, stage s on ranks 2s and 2s + 1
    staged = ParallelLayout(1, 2, 2)
    assert (staged.world_size, [staged.stage_of(r) for r in range(4)]) == (4, [0, 0, 1, 1])
    assert [(s.stage, s.experts, s.computes_logits) for s in shards_of(staged, moe)] == [
        (0, range(0, 4), False), (0, range(4, 8), False), (1, range(0, 4), True), (1, range(4, 8), False)]


def test_kv_map_of_repeated_attention_reads_once_and_writes_both_copies():
    moe = config(**{**MIXTRAL, "num_hidden_layers": 2})
    shards = shards_of(ParallelLayout(1, 1, 2), moe)
    pools = [torch.zeros(2, 2, 1, 1, 8, 1) for _ in shards]
    kv_map = build_kv_map(shards, pools, 2)
    assert [[id(p.pool) for p in kv_map.read[layer]] for layer in range(2)] == [[id(pools[0])]] * 2
    assert [{id(p.pool) for p in kv_map.write[layer]} for layer in range(2)] == [{id(pools[0]), id(pools[1])}] * 2


def test_stages_balance_what_an_expert_parallel_rank_holds():
    """Experts split 8 ways weigh less than a dense MLP: the dense first half moves to fewer ranks' stage."""
    moe = config(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4096,
                 num_hidden_layers=8, mlp_only_layers=[0, 1, 2, 3], vocab_size=256)
    assert [len(r) for r in ParallelLayout(1, 2).stages(moe)] == [5, 3]
    assert [len(r) for r in ParallelLayout(2, 2, 2).stages(moe)] == [5, 3]   # experts split as the heads are
    assert [len(r) for r in ParallelLayout(1, 2, 8).stages(moe)] == [3, 5]


def test_memory_counts_each_ranks_share_of_the_experts():
    moe = config(**MIXTRAL)
    whole = moe.num_parameters()
    experts = 32 * 8 * 3 * 4096 * 14336
    first, second = rank_parameters(moe, ParallelLayout(1, 1, 2))
    assert first == whole - experts // 2              # everything but the other rank's experts
    assert second == first - 32000 * 4096             # and no LM head: it computes no logits
    # tp=2, ep=2: halves of everything but the routers and norms, which both ranks hold
    replicated = 32 * (8 * 4096 + 2 * 4096) + 4096
    assert sum(rank_parameters(moe, ParallelLayout(2, 1, 2))) == whole + replicated
    assert rank_parameters(moe, ParallelLayout()) == [whole]


@pytest.mark.parametrize("layout, changes, message", [
    (ParallelLayout(1, 1, 2), {}, "expert_parallel_size 2 needs a mixture-of-experts model; this llama model is dense"),
    (ParallelLayout(1, 1, 3), MIXTRAL, "expert_parallel_size 3 does not divide the model's 8 experts; use one of [1, 2, 4, 8]"),
    (ParallelLayout(2, 1, 1), MIXTRAL, "tensor_parallel_size 2 alone does not split a mixture-of-experts model's experts"),
])
def test_expert_layouts_the_model_cannot_take_are_refused(layout, changes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        layout.check_model(config(**changes))


@pytest.mark.parametrize("layout, message", [
    (ParallelLayout(2, 1, 4), "expert_parallel_size 4 with tensor_parallel_size 2: the experts split across the "
                              "stage's tensor-parallel ranks"),
    (ParallelLayout(1, 1, 0), "expert_parallel_size must be an integer >= 1, got 0"),
])
def test_expert_layouts_that_mix_replicated_and_split_attention_are_refused(layout, message):
    with pytest.raises(ValueError, match=message):
        layout.validate()


def test_generate_command_takes_the_expert_parallel_size(tiny_model_dir, capsys):
    from deploy.cli import main

    command = ["generate", "--model", str(tiny_model_dir), "--prompt", "the quick brown fox", "--max-tokens", "2"]
    assert main([*command, "--expert-parallel-size", "2"]) == 2
    assert "expert_parallel_size 2 needs a mixture-of-experts model; this llama model is dense" in capsys.readouterr().err


@pytest.mark.parametrize("stacked", [False, True], ids=["one tensor per expert", "stacked experts"])
def test_an_expert_parallel_rank_loads_only_its_experts(tmp_path, stacked):
    """Rank 1 of ep=2 reads experts 2-3 of 4, from per-expert tensors or rows of stacked ones, and no LM head."""
    from safetensors.torch import load_file, save_file

    from engine.config import load_config
    from engine.loader import load_model
    from tests.engine.conftest import build_checkpoint

    build_checkpoint(tmp_path, "mixtral")
    (path,) = tmp_path.glob("*.safetensors")
    tensors = load_file(path)
    p = "model.layers.{}.block_sparse_moe.experts."
    expected = {i: (torch.stack([torch.cat([tensors[f"{p.format(i)}{e}.w1.weight"], tensors[f"{p.format(i)}{e}.w3.weight"]])
                                 for e in range(4)]),
                    torch.stack([tensors[f"{p.format(i)}{e}.w2.weight"] for e in range(4)])) for i in range(2)}
    if stacked:
        for i in range(2):
            for name in [n for n in tensors if n.startswith(p.format(i))]:
                del tensors[name]
            tensors[p.format(i) + "gate_up_proj"], tensors[p.format(i) + "down_proj"] = expected[i]
        save_file(tensors, str(path), metadata={"format": "pt"})
    cfg = load_config(tmp_path)
    layout = ParallelLayout(1, 1, 2)
    model = load_model(tmp_path, cfg, torch.device("cpu"), torch.float32, show_progress=False,
                       shard=rank_shard(layout, cfg, 1, layout.stages(cfg)))
    for i, layer in enumerate(model.weights.layers):
        assert torch.equal(layer.moe.gate_up, expected[i][0][2:4]) and torch.equal(layer.moe.down, expected[i][1][2:4])
        assert layer.moe.router.shape == (4, cfg.hidden_size)   # every rank routes over all experts
    assert model.weights.lm_head is None and model.weights.norm is not None
