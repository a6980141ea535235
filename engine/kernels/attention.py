"""paged_attention with engine.ops's contract, on the decode and prefill kernels.

Decode rows go to one batched decode launch; all prefill chunks go to one prefill launch. The
prefill launch needs the per-sequence query offsets and context lengths on the device; the model
calls this once per layer with the same AttentionBatch, so they are built on the first layer and
reused by the rest (one small host-to-device copy per step, not per layer).
"""

from __future__ import annotations

import torch

from engine.kernels.decode_attention import decode_attention
from engine.kernels.prefill_attention import prefill_attention
from engine.ops import AttentionBatch

_prefill_meta: tuple[AttentionBatch | None, torch.Tensor | None, torch.Tensor | None, int] = (None, None, None, 0)


def _prefill_tensors(batch: AttentionBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    global _prefill_meta
    cached_batch, query_start, context_lens, max_queries = _prefill_meta
    if cached_batch is not batch:
        first = batch.num_decode
        starts = batch.query_start[first:]
        base = starts[0]
        host = torch.tensor([s - base for s in starts] + batch.context_lens[first:], dtype=torch.int32)
        if device.type == "cuda":
            host = host.pin_memory()
        both = host.to(device, non_blocking=True)
        query_start, context_lens = both[: len(starts)], both[len(starts):]
        max_queries = max(b - a for a, b in zip(starts, starts[1:]))
        _prefill_meta = (batch, query_start, context_lens, max_queries)
    return query_start, context_lens, max_queries


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
                    scale: float, sliding_window: int | None, sinks: torch.Tensor | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    out = torch.empty_like(q)
    num_decode = batch.num_decode
    if num_decode:
        decode_attention(q[:num_decode], k_cache, v_cache, batch.block_tables, batch.decode_context_lens,
                         scale, sliding_window, out=out[:num_decode], sinks=sinks, softcap=softcap)
    if len(batch.context_lens) > num_decode:
        query_start, context_lens, max_queries = _prefill_tensors(batch, q.device)
        first_row = batch.query_start[num_decode]
        prefill_attention(q[first_row:], k_cache, v_cache, batch.block_tables[num_decode:], query_start,
                          context_lens, max_queries, scale, sliding_window, out[first_row:], sinks, softcap)
    return out
