"""What every rank does to start, rank 0 included, in the same order on all of them (the
collectives inside must pair up): connect, load its part of the checkpoint, agree on the KV pool's
block count, then allocate the pool and capture its CUDA graphs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.config import ModelConfig
from engine.loader import load_model
from engine.parallel.groups import RankGroups, agree_min, connect
from engine.parallel.layout import ParallelLayout, rank_shard
from engine.shard import ModelShard, max_model_len

if TYPE_CHECKING:
    import torch.distributed as dist

    from engine.engine import EngineConfig


def start_rank(store: dist.Store, layout: ParallelLayout, rank: int, model_dir: Path, model_config: ModelConfig,
               config: EngineConfig, device: torch.device, dtype: torch.dtype,
               show_progress: bool) -> tuple[RankGroups, ModelShard, int]:
    """This rank's groups, its loaded part of the model, and the KV block count every rank can hold."""
    groups = connect(store, layout, rank, device)
    shard_info = rank_shard(layout, model_config, rank, layout.stages(model_config))
    model = load_model(model_dir, model_config, device, dtype, show_progress, config.weight_mode, shard_info, groups.tp,
                       groups.experts)
    shard = ModelShard(model, config)
    return groups, shard, agree_min(groups.control, shard.blocks_fit())


def finish_rank(shard: ModelShard, num_blocks: int, pool: torch.Tensor | None, model_config: ModelConfig,
                config: EngineConfig) -> None:
    shard.allocate(num_blocks, pool)
    # from the agreed block count, so every rank rotates by the same longrope factors
    shard.max_model_len = max_model_len(config, model_config.max_position_embeddings, num_blocks)
    shard.model.serve_context(shard.max_model_len)
    shard.capture_graphs(shard.max_model_len)
