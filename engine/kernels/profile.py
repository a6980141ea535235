"""Activation memory of the largest step, measured by running it, so the KV pool can take the rest.

Plain torch (no triton): used by the engine on any CUDA device before it sizes its KV pool.
"""

from __future__ import annotations

import torch

from engine.ops import AttentionBatch


def activation_peak_bytes(model, num_tokens: int, num_sample_rows: int, block_size: int) -> int:
    """Peak memory above the current allocation while one prefill step of num_tokens runs
    (forward with a throwaway cache, then logits for num_sample_rows rows).

    The tokens are all the same, so in a mixture of experts they all route to the same experts:
    the most uneven split a step can have, whose expert batches are the largest."""
    cfg, device = model.config, model.device
    num_tokens = max(1, min(num_tokens, cfg.max_position_embeddings))
    num_blocks = -(-num_tokens // block_size)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    # one rank's part under tensor/pipeline/expert parallelism: its layers, its KV heads (every rank
    # profiles at the same point of start-up, so the all-reduces and all-to-alls inside the forward pair up)
    shape = cfg.kv_pool_shape(len(model.shard.layers), num_blocks, block_size, model.num_kv_heads)
    cache = torch.zeros(shape, dtype=model.dtype, device=device)
    cache_bytes = cache.numel() * cache.element_size()
    batch = AttentionBatch(
        num_decode=0, query_start=[0, num_tokens], context_lens=[num_tokens],
        block_tables=torch.arange(num_blocks, device=device)[None],
        decode_context_lens=torch.zeros(0, dtype=torch.int64, device=device),
        slot_mapping=torch.arange(num_tokens, device=device),
    )
    positions = torch.arange(num_tokens, device=device)
    hidden_in = None
    if not model.shard.is_first_stage:
        hidden_in = torch.zeros((num_tokens, cfg.hidden_size), dtype=model.dtype, device=device)
    hidden = model.forward(torch.zeros(num_tokens, dtype=torch.int64, device=device), positions, batch, cache, hidden_in)
    if model.shard.computes_logits and model.weights.lm_head is not None:
        model.compute_logits(hidden[-min(num_sample_rows, num_tokens):])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - cache_bytes
    del cache, hidden
    torch.cuda.empty_cache()
    return max(0, peak)
