"""Rotary embedding (rotate-half layout) of q and k in one launch: one program per token.

Tables narrower than the heads (partial rotary, Phi-4-mini) rotate each head's first dims and copy the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import next_pow2


@triton.jit
def _rotate_heads(x_ptr, out_ptr, cos1, sin1, cos2, sin2, row, num_heads, half, num_pass,
                  stride_xt, stride_xh, stride_ot, stride_oh, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  BLOCK_PASS: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < half)
    x_off = row * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    o_off = row * stride_ot + heads[:, None] * stride_oh + cols[None, :]
    x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + x_off + half, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(out_ptr + o_off, (a * cos1[None, :] - b * sin1[None, :]).to(x1.dtype), mask=mask)
    tl.store(out_ptr + o_off + half, (b * cos2[None, :] + a * sin2[None, :]).to(x1.dtype), mask=mask)
    if BLOCK_PASS > 0:   # the dims past the rotary ones, copied unchanged
        rest = tl.arange(0, BLOCK_PASS)
        pass_mask = (heads[:, None] < num_heads) & (rest[None, :] < num_pass)
        x_rest = row * stride_xt + heads[:, None] * stride_xh + 2 * half + rest[None, :]
        o_rest = row * stride_ot + heads[:, None] * stride_oh + 2 * half + rest[None, :]
        tl.store(out_ptr + o_rest, tl.load(x_ptr + x_rest, mask=pass_mask, other=0.0), mask=pass_mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_ptr, sin_ptr,
                   num_heads, num_kv_heads, half, num_pass, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_qot, stride_qoh, stride_kot, stride_koh, stride_table,
                   BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + row)
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < half
    # The tables repeat each frequency in both halves; read both halves as the torch op does.
    cos1 = tl.load(cos_ptr + pos * stride_table + cols, mask=cmask, other=0.0)
    sin1 = tl.load(sin_ptr + pos * stride_table + cols, mask=cmask, other=0.0)
    cos2 = tl.load(cos_ptr + pos * stride_table + half + cols, mask=cmask, other=0.0)
    sin2 = tl.load(sin_ptr + pos * stride_table + half + cols, mask=cmask, other=0.0)
    _rotate_heads(q_ptr, q_out_ptr, cos1, sin1, cos2, sin2, row, num_heads, half, num_pass,
                  stride_qt, stride_qh, stride_qot, stride_qoh, BLOCK_H, BLOCK_HALF, BLOCK_PASS)
    _rotate_heads(k_ptr, k_out_ptr, cos1, sin1, cos2, sin2, row, num_kv_heads, half, num_pass,
                  stride_kt, stride_kh, stride_kot, stride_koh, BLOCK_HKV, BLOCK_HALF, BLOCK_PASS)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as engine.ops.apply_rotary; q and k may be strided views of the qkv projection."""
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    cos_table, sin_table = cos_table.contiguous(), sin_table.contiguous()
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k, memory_format=torch.contiguous_format)
    num_tokens, num_heads, head_dim = q.shape
    half = cos_table.shape[1] // 2
    num_pass = head_dim - 2 * half
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cos_table, sin_table, num_heads, k.shape[1], half, num_pass,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
            k_out.stride(0), k_out.stride(1), cos_table.stride(0),
            BLOCK_H=next_pow2(num_heads), BLOCK_HKV=next_pow2(k.shape[1]), BLOCK_HALF=next_pow2(half),
            BLOCK_PASS=next_pow2(num_pass) if num_pass else 0)
    return q_out, k_out
