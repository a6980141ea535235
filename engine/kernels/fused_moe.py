"""Mixture-of-experts MLP on CUDA: grouped GEMMs over tokens sorted by expert, engine.ops.fused_moe's twin.

The T * k (token, expert) pairs are sorted by expert and each expert's run is padded to a whole
number of BLOCK_M rows, so every row block belongs to one expert. Two launches then cover all
experts at once, each program reading the expert's weights for its block:

1. gate_up: rows x [BLOCK_M, hidden] @ gate_up[e].T, gate and up halves in two accumulators, SiLU(gate)
   * up written to an [T * k, inter] buffer (the [T * k, 2 * inter] projection never exists).
2. down: that buffer @ down[e].T, scaled by the pair's router weight, into [T * k, hidden]; the k rows
   of a token are summed after.

gpt-oss's experts also add a bias to each projection (per expert, before the activation and before
the router weight) and activate by the clamped SwiGLU (engine.ops.clamped_swiglu): both constexpr
variants of the same two kernels.

The sort and padding are device-side torch ops on shapes known up front (the padded length is
bounded by T * k + min(T * k, E) * (BLOCK_M - 1)), so nothing waits on the GPU and a decode step
with this kernel can be captured in a CUDA graph. Blocks past the used length exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import dot_options

BLOCK_N = 64
BLOCK_K = 32


def _block_m(num_pairs: int, num_experts: int) -> int:
    # Few rows per expert (decode) waste most of a 64-row block on padding; many rows fill it.
    return 16 if num_pairs < 4 * num_experts else 64


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [padded] int32: pair index t * k + j in expert order, T * k in padding rows;
    block_expert [num_blocks] int32: the expert of each BLOCK_M rows, num_experts past the end)."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    expert_of_sorted = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[expert_of_sorted]
    dest = (padded_end - padded)[expert_of_sorted] + rank
    num_blocks = triton.cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _block(sorted_pairs_ptr, block_expert_ptr, num_pairs, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's expert, its BLOCK_M pair indices (masked past num_pairs) and its BLOCK_N output columns."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, pairs, pairs < num_pairs, cols, cols < n_cols


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, bias_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, hidden, inter,
                    stride_xt, stride_we, stride_wn, stride_ot, stride_be, num_experts, swiglu_alpha, swiglu_limit,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr):
    expert, pairs, row_mask, cols, col_mask = _block(sorted_pairs_ptr, block_expert_ptr, num_pairs, inter,
                                                     BLOCK_M, BLOCK_N)
    if expert >= num_experts:
        return
    tokens = (pairs // TOP_K).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = k0 + ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + (k0 + ks)[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        # [BLOCK_K, BLOCK_N] tiles of the gate rows and of the up rows (inter further down) of gate_up[e]
        w_gate = tl.load(w_base + cols[None, :] * stride_wn + (k0 + ks)[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (cols[None, :] + inter) * stride_wn + (k0 + ks)[:, None], mask=w_mask, other=0.0)
        if DOT_F32:
            a, w_gate, w_up = a.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
        acc_gate = tl.dot(a, w_gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
    if HAS_BIAS:
        bias = bias_ptr + expert * stride_be + cols
        acc_gate += tl.load(bias, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias + inter, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:   # (up.clamp(-limit, limit) + 1) * gate * sigmoid(alpha * gate), gate clamped to at most limit
        gate = tl.minimum(acc_gate, swiglu_limit)
        up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
        activated = gate / (1.0 + tl.exp(-swiglu_alpha * gate)) * (up + 1.0)
    else:
        activated = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_ot + cols[None, :],
             activated.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, out_ptr, weights_ptr, bias_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, hidden,
                 inter, stride_at, stride_we, stride_wn, stride_ot, stride_be, num_experts,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_F32: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr):
    expert, pairs, row_mask, cols, col_mask = _block(sorted_pairs_ptr, block_expert_ptr, num_pairs, hidden,
                                                     BLOCK_M, BLOCK_N)
    if expert >= num_experts:
        return
    rows = pairs.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = k0 + ks < inter
        a = tl.load(act_ptr + rows[:, None] * stride_at + (k0 + ks)[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + (k0 + ks)[:, None],
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if DOT_F32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    route_weight = tl.load(weights_ptr + rows, mask=row_mask, other=0.0)
    tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :], (acc * route_weight[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
              swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """Same contract as engine.ops.fused_moe."""
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden, inter = down.shape
    num_pairs = num_tokens * top_k
    assert gate_up.stride(-1) == 1 and down.stride(-1) == 1, "expert weights are stored row-major"
    if num_pairs == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_m = _block_m(num_pairs, num_experts)
    sorted_pairs, block_expert = align_by_expert(topk_ids, num_experts, block_m)
    num_blocks = block_expert.numel()
    dot_f32, precision = dot_options(x.dtype)
    activated = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    has_bias = gate_up_bias is not None
    if has_bias:
        gate_up_bias, down_bias = gate_up_bias.contiguous(), down_bias.contiguous()
    alpha, limit = swiglu or (1.0, 0.0)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, BLOCK_N))](
        x, gate_up, activated, gate_up_bias if has_bias else x, sorted_pairs, block_expert, num_pairs, hidden, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), activated.stride(0),
        gate_up_bias.stride(0) if has_bias else 0, num_experts, alpha, limit,
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_F32=dot_f32, PRECISION=precision,
        HAS_BIAS=has_bias, SWIGLU=swiglu is not None)
    per_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden, BLOCK_N))](
        activated, down, per_pair, topk_weights.contiguous(), down_bias if has_bias else x, sorted_pairs,
        block_expert, num_pairs, hidden, inter, activated.stride(0), down.stride(0), down.stride(1),
        per_pair.stride(0), down_bias.stride(0) if has_bias else 0, num_experts,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_F32=dot_f32, PRECISION=precision, HAS_BIAS=has_bias)
    return per_pair.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)
