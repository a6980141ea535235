"""Scatter new keys and values into the paged cache; slot -1 (a CUDA-graph padding row) is skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import next_pow2


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, num_kv_heads, head_dim,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + row)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    slots = tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot  # a tensor, so the mask below broadcasts
    mask = (heads[:, None] < num_kv_heads) & (cols[None, :] < head_dim) & (slots >= 0)
    cache_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + heads[:, None] * stride_ch + cols[None, :]
    k = tl.load(k_ptr + row * stride_kt + heads[:, None] * stride_kh + cols[None, :], mask=mask)
    v = tl.load(v_ptr + row * stride_vt + heads[:, None] * stride_vh + cols[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Same contract as engine.ops.write_kv; k and v may be strided views of the qkv projection."""
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert k_cache.stride() == v_cache.stride(), "K and V caches share one layout"
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens:
        _write_kv_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            BLOCK_SIZE=k_cache.shape[1], BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim))
