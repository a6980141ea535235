"""What a model needs in memory before it is loaded: its weights (every expert of a mixture of
experts is resident, not only the few a token activates) plus the KV pool, against what the device
has. Checked up front so an oversized model fails with a message instead of an out-of-memory kill
half-way through loading.

Under tensor/pipeline/expert parallelism each rank holds its part (engine.parallel.layout.RankShard),
counted here exactly as the loader reads it: its stage's layers, its heads and MLP rows, its run of
each MoE layer's experts (1/ep of them; the router whole), its vocabulary rows. Ranks that replicate
attention for expert parallelism each hold a copy of it, and of the embedding.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import InsufficientMemoryError
from engine.parallel.layout import ParallelLayout, RankShard, layer_parameters, rank_shard, whole_model

log = logging.getLogger(__name__)

GIB = 1 << 30
CPU_KV_BYTES = 256 << 20   # a CPU rank's KV pool when kv_cache_bytes is not given (engine.shard)
# A CPU rank process's own memory before its weights and pool: Python, torch and gloo (~150 MiB measured
# per worker). Counted so that a layout of hundreds of ranks is refused here, not met by the OOM killer.
RANK_PROCESS_BYTES = 160 << 20


def shard_parameters(cfg: ModelConfig, shard: RankShard, lm_head_stored: bool = False) -> int:
    """Weight elements one rank holds (the whole model for `whole_model(cfg)`). lm_head_stored: the checkpoint
    has an lm_head.weight tensor, which the loader reads even for a tied model (engine.loader.stores_lm_head)."""
    hidden = cfg.hidden_size
    total = sum(layer_parameters(cfg, layer, len(shard.heads), len(shard.kv_heads), len(shard.mlp), len(shard.experts))
                for layer in shard.layers)
    vocab_rows = len(shard.vocab) * hidden
    embed = vocab_rows if shard.is_first_stage else 0
    # Tied on the first stage: the embedding itself, unless the checkpoint stores lm_head.weight as well; the
    # loader keeps that one apart when it differs (as transformers does), and holds both while comparing them.
    tied = cfg.tie_word_embeddings and not lm_head_stored
    lm_head = vocab_rows if shard.computes_logits and not (tied and shard.is_first_stage) else 0
    final_norm = hidden * (2 if cfg.norm_bias else 1) if cfg.norm_weights else 0   # StarCoder2's has a bias
    return total + embed + lm_head + (final_norm if shard.is_last_stage else 0)


def rank_parameters(cfg: ModelConfig, layout: ParallelLayout, lm_head_stored: bool = False) -> list[int]:
    """Weight elements of each rank of `layout`, by rank."""
    if layout.world_size == 1:
        return [shard_parameters(cfg, whole_model(cfg), lm_head_stored)]
    stages = layout.stages(cfg)
    return [shard_parameters(cfg, rank_shard(layout, cfg, rank, stages), lm_head_stored)
            for rank in range(layout.world_size)]


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, lm_head_stored: bool = False) -> int:
    return shard_parameters(cfg, whole_model(cfg), lm_head_stored) * torch.tensor([], dtype=dtype).element_size()


def available_bytes(device: torch.device) -> int | None:
    """Free memory on the device (GPU: free device memory; CPU: the kernel's MemAvailable), None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, kv_cache_bytes: int | None,
               layout: ParallelLayout | None = None, lm_head_stored: bool = False) -> int:
    """The model's weight bytes; raises InsufficientMemoryError when a rank's weights plus its KV pool
    exceed free memory (lm_head_stored: as for shard_parameters).

    On GPUs each rank has a device of its own: the rank holding the most must fit (checked against
    the first device; the engine's GPUs are alike). On CPU the ranks share the host's memory: every
    rank's weights (replicas included), every rank's pool (CPU_KV_BYTES when kv_cache_bytes is not
    given) and every worker process's own memory (RANK_PROCESS_BYTES)."""
    layout = layout or ParallelLayout()
    element = torch.tensor([], dtype=dtype).element_size()
    weights = weight_bytes(cfg, dtype, lm_head_stored)
    per_rank = [n * element for n in rank_parameters(cfg, layout, lm_head_stored)]
    kv = kv_cache_bytes if kv_cache_bytes is not None else CPU_KV_BYTES if device.type == "cpu" else 0
    if device.type == "cuda":
        needed, held = max(per_rank) + kv, max(per_rank)
    else:
        held = sum(per_rank)
        needed = held + layout.world_size * kv + (layout.world_size - 1) * RANK_PROCESS_BYTES
    experts = ""
    if cfg.moe is not None:
        num_sparse = sum(cfg.moe.sparse_layers)
        split = f", {cfg.moe.num_experts // layout.ep} per rank" if layout.ep > 1 else ""
        experts = f", all {cfg.moe.num_experts} experts of its {num_sparse} MoE layers resident{split}"
    where = "" if layout.world_size == 1 else f" ({layout}: {max(per_rank) / GIB:.2f} GiB on the largest rank)"
    log.info("weights: %.2f GiB in %s%s%s", weights / GIB, str(dtype).removeprefix("torch."), experts, where)
    available = available_bytes(device)
    if available is not None and needed > available:
        pool = f" + a {kv / GIB:.2f} GiB KV pool" if kv else ""
        scope = "" if layout.world_size == 1 else (
            f" ({layout}: {held / GIB:.2f} GiB on the largest rank)" if device.type == "cuda"
            else f" ({layout}: {held / GIB:.2f} GiB across its {layout.world_size} ranks, a pool each, and "
                 f"{layout.world_size - 1} worker processes of {RANK_PROCESS_BYTES >> 20} MiB)")
        fewer = "" if layout.world_size == 1 else (
            ", fewer ranks (tensor_parallel_size, pipeline_parallel_size, expert_parallel_size)")
        raise InsufficientMemoryError(
            f"the model needs {weights / GIB:.2f} GiB of weights{experts}{pool}{scope}, but {device} has "
            f"{available / GIB:.2f} GiB free; use a smaller dtype or KV pool (kv_cache_bytes){fewer}, or a device "
            f"with more memory")
    return weights
