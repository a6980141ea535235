"""A matmul of a few rows against a large weight on the CPU, in C (cpu_matmul.c): the shape of every
weight matmul in a decode step, and of each expert's in a mixture-of-experts decode step (a few rows
per expert).

Why C. At a few rows a matmul reads each weight once and does little with it, so it runs at the
speed the weight streams from memory. torch's CPU matmul at 2-16 rows streams it well below the rate
a plain read reaches; the C loop prefetches the weight rows it multiplies next and keeps the few
input rows in L1. On the project's 2-core Intel Xeon (benchmarks/cpu_matmul.py, quiet) the 32 expert
matmuls of a MoE decode step at 8 rows each took 6.5 ms against 9.7 ms, and whole benchmark runs of
the engine were 10.8% (MoE) and 4.8% (dense) shorter (benchmarks/RESULTS.md, "A matmul of a few rows
in C").

The extension is built by the editable install (pyproject.toml, optional); where it is missing, or
for shapes it does not take, ops.linear keeps torch's matmul.
"""

from __future__ import annotations

import torch

try:
    from engine import _cpu_matmul
    MISSING = ""
except ImportError as exc:  # not built: torch's matmul does every product
    _cpu_matmul = None
    MISSING = str(exc)

MAX_ROWS = 16
# One row is a matrix-vector product, which torch already streams at the memory's speed.
MIN_ROWS = 2
LANES = 16
# Below this many weight elements (256 KiB of float32) the weight sits in cache and torch is as fast.
MIN_WEIGHT_ELEMENTS = 1 << 16


def available() -> bool:
    return _cpu_matmul is not None


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether matmul() takes x [rows, in], weight [out, in] and bias (None or [out])."""
    return (_cpu_matmul is not None and x.shape[0] <= MAX_ROWS and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.device.type == "cpu" and x.shape[1] % LANES == 0
            and weight.numel() >= MIN_WEIGHT_ELEMENTS and weight.is_contiguous() and x.shape[0] >= MIN_ROWS
            and (bias is None or bias.dtype == torch.float32 and bias.shape == weight.shape[:1]))


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight [out, in].T (+ bias [out], float32: added to each total as `+ bias` after the matmul
    would add it) on torch's threads (takes() must hold)."""
    x = x.contiguous()
    rows, k = x.shape
    out = torch.empty((rows, weight.shape[0]), dtype=x.dtype)
    _cpu_matmul.matmul(x.numpy(), weight.numpy(), out.numpy(), None if bias is None else bias.contiguous().numpy(),
                       rows, weight.shape[0], k, torch.get_num_threads())
    return out
