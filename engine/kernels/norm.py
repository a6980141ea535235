"""Fused RMSNorm and residual-add + RMSNorm: one read and one write of each row; Cohere's LayerNorm (the row's mean
subtracted first) is the same kernel with SUBTRACT_MEAN.

As engine.ops.rms_norm, a float32 weight (Gemma 3's 1 + weight) multiplies the float32 row and the product
is rounded to the activations' dtype; a weight in their dtype multiplies the row already rounded."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, n_cols, n_weight_rows, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RESIDUAL: tl.constexpr, ROUND_FIRST: tl.constexpr, SUBTRACT_MEAN: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # Round the sum to the model dtype first, as `residual + x` does in torch.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    if SUBTRACT_MEAN:   # the masked columns stay 0, out of the variance's sum
        x32 = tl.where(mask, x32 - tl.sum(x32, axis=0) / n_cols, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    # rows cycle through the weight's rows: one for all, or Command R+'s q/k norms' one per head
    w = tl.load(weight_ptr + (row % n_weight_rows) * n_cols + cols, mask=mask, other=0.0)
    y = x32 * rstd
    if ROUND_FIRST:   # torch casts the normalized row to x's dtype before the weight multiply; so do we
        y = y.to(x.dtype).to(tl.float32)
    y = y * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _weight_rows(weight: torch.Tensor) -> int:
    """The weight's rows: 1, or those of [H, D] weights (one row per head, contiguous as loaded) that x [T, H, D]'s
    rows take in turn."""
    return weight.numel() // weight.shape[-1]


def _out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return x.dtype if weight.dtype == torch.float32 else torch.promote_types(x.dtype, weight.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, weight, eps, subtract_mean=False)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _add_norm(x, residual, weight, eps, subtract_mean=False)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, weight, eps, subtract_mean=True)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _add_norm(x, residual, weight, eps, subtract_mean=True)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, subtract_mean: bool) -> torch.Tensor:
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=_out_dtype(x, weight), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, out, out, rows.shape[1], _weight_rows(weight), eps,
                                           rows.stride(0), rows.stride(0), out.stride(0), out.stride(0),
                                           HAS_RESIDUAL=False, ROUND_FIRST=weight.dtype != torch.float32,
                                           SUBTRACT_MEAN=subtract_mean, BLOCK=next_pow2(rows.shape[1]))
    return out.view(x.shape)


def _add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
              subtract_mean: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows, res_rows = _rows(x), _rows(residual)
    out = torch.empty(rows.shape, dtype=_out_dtype(x, weight), device=x.device)
    residual_out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, res_rows, weight, out, residual_out, rows.shape[1],
                                           _weight_rows(weight), eps,
                                           rows.stride(0), res_rows.stride(0), out.stride(0), residual_out.stride(0),
                                           HAS_RESIDUAL=True, ROUND_FIRST=weight.dtype != torch.float32,
                                           SUBTRACT_MEAN=subtract_mean, BLOCK=next_pow2(rows.shape[1]))
    return out.view(x.shape), residual_out.view(x.shape)
