"""Launch helpers shared by the kernels: block sizes and how tl.dot is asked to multiply."""

from __future__ import annotations

import torch
import triton

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
