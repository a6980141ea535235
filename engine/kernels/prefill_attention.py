"""Paged prefill attention: a chunk of queries per sequence attends its whole cached prefix.

Keys come from the paged cache (written by write_kv before this runs), so prefix-cache hits and
chunked prefill take the same path as a fresh prompt: query i of a sequence with n new queries and
context length L sits at position L - n + i and sees keys up to it (and, with a sliding window,
no further back than the window; with a negative one, Llama 4's chunked attention, none before its own chunk of
-window tokens). One program per (sequence, query head, tile of queries); the
key loop stops at the tile's causal limit. gpt-oss's sinks (one learned logit per query head in the softmax's
denominator, weighing no value) start each row's running max and sum at the sink and 1. Gemma 2's soft-capping
(SOFTCAP, a compiled variant of its own) caps each tile's scaled scores before the mask.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.kernels.common import dot_options, next_pow2, soft_cap

BLOCK_M = 32   # queries per program
BLOCK_N = 32   # keys per inner-loop tile


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr,
                    sinks_ptr, qk_scale, softcap, head_dim, stride_qt, stride_qh, stride_cb, stride_cs, stride_ch,
                    stride_bt, stride_ot, stride_oh, GROUP: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, SINKS: tl.constexpr, SOFTCAP: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    tile_m = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq).to(tl.int32)
    num_queries = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_start
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    first_pos = context_len - num_queries  # position of this sequence's first query
    kv_head = head // GROUP

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < num_queries
    d_mask = offs_d < head_dim
    q_pos = first_pos + offs_m
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    # Keys this tile can see: up to its last query's position, from its first query's window start.
    last_query = tl.minimum((tile_m + 1) * BLOCK_M, num_queries)
    hi = tl.where(tile_m * BLOCK_M < num_queries, first_pos + last_query, 0)
    lo = 0
    if WINDOW > 0:  # constexpr: one compiled variant per window size, no runtime branch
        lo = tl.maximum(first_pos + tile_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    if WINDOW < 0:  # chunked attention: from the chunk of the tile's first query
        lo = (first_pos + tile_m * BLOCK_M) // -WINDOW * -WINDOW // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:   # the sink is a natural-log logit; scores here are in base 2 (qk_scale holds log2(e))
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        l_i = l_i + 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for tile in range(lo, hi, BLOCK_N):
        pos = tile + offs_n
        valid = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0)
        kv_off = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if SOFTCAP:   # the cap in base 2 as the scores are (softcap holds log2(e) too)
            s = soft_cap(s, softcap)
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
        if WINDOW < 0:
            visible = visible & (pos[None, :] >= q_pos[:, None] // -WINDOW * -WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start: torch.Tensor, context_lens: torch.Tensor, max_queries: int, scale: float,
                      sliding_window: int | None, out: torch.Tensor, sinks: torch.Tensor | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """Attend prefill chunks of q [T, H, D] into out [T, H, D].

    Sequence i owns rows query_start[i]:query_start[i+1] of q and row i of block_tables, and has
    context_lens[i] tokens in cache; max_queries bounds the rows of any one sequence (grid size); sinks [H]
    float32 or None; softcap: scaled scores become softcap * tanh(score / softcap), or None.
    """
    num_seqs = context_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    if num_seqs == 0 or max_queries == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.stride() == v_cache.stride(), "K and V caches share one layout"
    dot_f32, precision = dot_options(q.dtype)
    grid = (num_seqs, num_heads, triton.cdiv(max_queries, BLOCK_M))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start, context_lens, out if sinks is None else sinks,
        scale * math.log2(math.e), (softcap or 0.0) * math.log2(math.e), head_dim,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), GROUP=num_heads // k_cache.shape[2], BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, WINDOW=sliding_window or 0, DOT_F32=dot_f32,
        PRECISION=precision, SINKS=sinks is not None, SOFTCAP=softcap is not None)
    return out
