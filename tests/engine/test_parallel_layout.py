"""What each rank of a tensor/pipeline-parallel engine holds: pure functions, no processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import parse_config
from engine.parallel.kv_pool import build_kv_map
from engine.parallel.layout import ParallelLayout, rank_shard, split_layers

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
    with pytest.raises(ValueError, match="does not split a mixture-of-experts model's experts"):
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
