"""SiLU(gate) * up, or GELU-tanh(gate) * up (Gemma 3), over the fused gate_up projection, without
materialising either half."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per program: wide enough to keep loads coalesced, small enough for many programs.
BLOCK = 1024


@triton.jit
def _act_and_mul_kernel(gate_up_ptr, out_ptr, n_cols, stride_in, stride_out, GELU_TANH: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU_TANH:   # 0.5 g (1 + tanh(u)) = g sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3)
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = g / (1.0 + tl.exp(-2.0 * u))
    else:
        act = g / (1.0 + tl.exp(-g))
    # Round the activation to the input dtype before the multiply, as F.silu(gate) * up does.
    out = act.to(gate.dtype).to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(gate_up, gelu_tanh=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(gate_up, gelu_tanh=True)


def _act_and_mul(gate_up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n_cols = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], n_cols), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(n_cols, BLOCK))
        _act_and_mul_kernel[grid](rows, out, n_cols, rows.stride(0), out.stride(0), GELU_TANH=gelu_tanh,
                                  BLOCK=BLOCK)
    return out.view(*gate_up.shape[:-1], n_cols)
