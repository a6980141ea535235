"""Triton kernels for the engine's hot ops on NVIDIA GPUs.

engine.ops stays the reference and the CPU path; this package is its fast twin. Importing it does
not import triton: `available()` says whether the fast path can run here, and only then does
engine.ops.for_device hand the model `engine.kernels.ops`, the kernel-backed ops with the same
signatures. Under TRITON_INTERPRET=1 the kernels also run on CPU tensors, which is how CI checks
them against the torch ops.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def available() -> bool:
    """True when CUDA and triton are both present (EDGEFIRE_DISABLE_KERNELS=1 turns the fast path off)."""
    if os.environ.get("EDGEFIRE_DISABLE_KERNELS") == "1":
        return False
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when triton runs kernels on the CPU through its numpy interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"
