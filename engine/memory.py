"""What a model needs in memory before it is loaded: its weights (every expert of a mixture of
experts is resident, not only the few a token activates) plus the KV pool, against what the device
has. Checked up front so an oversized model fails with a message instead of an out-of-memory kill
half-way through loading.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import InsufficientMemoryError

log = logging.getLogger(__name__)

GIB = 1 << 30


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return cfg.num_parameters() * torch.tensor([], dtype=dtype).element_size()


def available_bytes(device: torch.device) -> int | None:
    """Free memory on the device (GPU: free device memory; CPU: the kernel's MemAvailable), None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, kv_cache_bytes: int | None,
               num_ranks: int = 1) -> int:
    """The model's weight bytes; raises InsufficientMemoryError when weights plus the KV pool exceed free memory.

    With tensor/pipeline parallelism over num_ranks GPUs, each device holds about 1/num_ranks of the
    weights and its own KV pool; on CPU the ranks share the host's memory: all the weights, num_ranks pools."""
    weights = weight_bytes(cfg, dtype)
    available = available_bytes(device)
    if device.type == "cuda":
        needed = weights // num_ranks + (kv_cache_bytes or 0)
    else:
        needed = weights + num_ranks * (kv_cache_bytes or 0)
    experts = ""
    if cfg.moe is not None:
        num_sparse = sum(cfg.moe.sparse_layers)
        experts = f", all {cfg.moe.num_experts} experts of its {num_sparse} MoE layers resident"
    log.info("weights: %.2f GiB in %s%s", weights / GIB, str(dtype).removeprefix("torch."), experts)
    if available is not None and needed > available:
        kv = f" + a {kv_cache_bytes / GIB:.2f} GiB KV pool" if kv_cache_bytes else ""
        raise InsufficientMemoryError(
            f"the model needs {weights / GIB:.2f} GiB of weights{experts}{kv}, but {device} has "
            f"{available / GIB:.2f} GiB free; use a smaller dtype or KV pool (kv_cache_bytes), or a device with more memory")
    return weights
