"""Paged decode attention: one query token per sequence, keys read straight from the block table.

One program per (sequence, KV head, split) attends the whole GQA group of query heads that share
the KV head, so each key and value is loaded once. Long contexts are cut into splits ("flash
decoding") so a small batch still fills the GPU; a second kernel merges the splits' partial
softmaxes. The grid depends only on the batch size, never on context lengths, so a CUDA graph
captured once replays for any context (sequences with context length 0, the graph's padding rows,
produce zeros). gpt-oss's sinks (one learned logit per query head in the softmax's denominator, weighing
no value) start split 0's running max and sum at the sink and 1, as if it were a key scored first; the
merge then counts it once. Gemma 2's soft-capping (SOFTCAP, a compiled variant of its own) caps each tile's
scaled scores before their softmax. A negative window is Llama 4's chunked attention: only the keys of the query's
own chunk of -window tokens.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from engine.kernels.common import dot_options, next_pow2, soft_cap

# Keys per inner-loop tile (spans several cache blocks when blocks are small).
BLOCK_N = 64
MAX_SPLITS = 32


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
                   part_out_ptr, part_lse_ptr, sinks_ptr, qk_scale, softcap, head_dim,
                   stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, WINDOW: tl.constexpr,
                   DOT_F32: tl.constexpr, PRECISION: tl.constexpr, SINKS: tl.constexpr, SOFTCAP: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    start = 0
    if WINDOW > 0:  # constexpr: one compiled variant per window size, no runtime branch
        start = tl.maximum(context_len - WINDOW, 0)
    if WINDOW < 0:  # chunked attention: the query's own chunk of -WINDOW keys (a padding row's context is 0)
        start = tl.maximum(context_len - 1, 0) // -WINDOW * -WINDOW
    per_split = tl.cdiv(tl.cdiv(context_len - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, context_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < head_dim
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    if SINKS:   # the sinks are natural-log logits; scores here are in base 2 (qk_scale holds log2(e))
        sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        first = (split == 0) & g_mask
        m_i = tl.where(first, sink, m_i)
        l_i = tl.where(first, 1.0, l_i)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
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
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # l_i == 0 only for an empty range (padding row or an idle split): emit zeros, not NaN.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # Partials: [seqs, heads, splits, D] normalized outputs and [seqs, heads, splits] log2-sum-exp.
        num_heads = tl.num_programs(1) * GROUP
        row = (seq * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * head_dim + offs_d[None, :], out, mask=o_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, head_dim, stride_ot, stride_oh,
                         NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < head_dim
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    part = tl.load(part_out_ptr + (row * NUM_SPLITS + offs_s)[:, None] * head_dim + offs_d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(device: torch.device, num_seqs: int, num_kv_heads: int) -> int:
    """Splits so that about two programs run per SM. Depends only on the batch shape, so a CUDA
    graph captured for a batch size stays valid; short contexts just leave some splits idle."""
    if device.type != "cuda":
        return 1
    want = 2 * _num_sms(device.index or 0)
    return max(1, min(MAX_SPLITS, want // max(1, num_seqs * num_kv_heads)))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, sliding_window: int | None,
                     out: torch.Tensor | None = None, num_splits: int | None = None,
                     sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [B, H, D] (one query per sequence, the last position of its context); caches
    [num_blocks, block_size, Hkv, D]; block_tables [>=B, max_blocks]; context_lens [B]; sinks [H] float32 or
    None; softcap: scaled scores become softcap * tanh(score / softcap), or None. Returns [B, H, D]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.stride() == v_cache.stride(), "K and V caches share one layout"
    splits = num_splits or default_num_splits(q.device, num_seqs, num_kv_heads)
    dot_f32, precision = dot_options(q.dtype)
    block_d = max(16, next_pow2(head_dim))
    if splits > 1:
        part_out = torch.empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused by the single-split kernel
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        out if sinks is None else sinks, scale * math.log2(math.e), (softcap or 0.0) * math.log2(math.e), head_dim,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, next_pow2(group)), BLOCK_D=block_d, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N=BLOCK_N, NUM_SPLITS=splits, WINDOW=sliding_window or 0, DOT_F32=dot_f32, PRECISION=precision,
        SINKS=sinks is not None, SOFTCAP=softcap is not None)
    if splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, head_dim, out.stride(0), out.stride(1),
            NUM_SPLITS=splits, BLOCK_S=next_pow2(splits), BLOCK_D=block_d)
    return out
