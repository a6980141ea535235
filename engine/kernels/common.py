"""Launch helpers shared by the kernels: block sizes and how tl.dot is asked to multiply; and the attention
kernels' soft-capping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import interpreting


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def dot_options(dtype: torch.dtype) -> tuple[bool, str | None]:
    """(upcast operands to fp32 before tl.dot, input_precision).

    The interpreter multiplies bf16/fp16 dots as raw integers (numpy has no bf16), so under it the
    kernels upcast first; on a GPU they keep the half-precision tensor-core dot. fp32 inputs ask for
    "ieee" so a float32 engine is not silently rounded to tf32; other dtypes take triton's default.
    """
    return interpreting(), "ieee" if dtype == torch.float32 else None


@triton.jit
def soft_cap(s, cap):
    """cap * tanh(s / cap), Gemma 2's soft-capping of attention scores, from exp2 alone (the interpreter has no
    tanh): tanh(a) = (1 - e^-2a) / (1 + e^-2a) for a = |s| / cap, the sign put back after; below a = 1/4, where that
    difference cancels, tanh's odd series to a^7 (both within a few float32 ulp)."""
    a = tl.abs(s) / cap
    e = tl.exp2(-2.885390081777927 * a)   # e^-2a: 2 log2(e)
    a2 = a * a
    series = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * -0.05396825396825397)))
    t = cap * tl.where(a < 0.25, series, (1.0 - e) / (1.0 + e))
    return tl.where(s < 0, -t, t)
