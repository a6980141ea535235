"""Decoding on a device: the Triton kernel on CUDA (when triton is there), the torch decoder elsewhere."""

from __future__ import annotations

import torch

from engine.compression.checkpoint import verify_output
from engine.compression.format import CompressedTensor
from engine.compression.tables import pair_table


def uses_kernel(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    from engine import kernels
    return kernels.available()


def decompress_into(t: CompressedTensor, out: torch.Tensor, table: torch.Tensor) -> None:
    """Decode t into out (int16, contiguous; on t's device). On CUDA out needs t.numel rounded up to
    even elements; t, table and out live on the same device."""
    if out.device.type == "cuda":
        from engine.compression import triton_decoder
        triton_decoder.decompress_into(t, out, table)
    else:
        from engine.compression import torch_decoder
        torch_decoder.decompress_into(t, out[: t.numel], table)


def decompress_on(t: CompressedTensor, device: torch.device) -> torch.Tensor:
    """The original bf16 tensor on device, decoded there when a kernel can."""
    table = pair_table(t.palette, t.code_lengths)
    if uses_kernel(device):
        t, table = t.to(device), table.to(device)
        out = torch.empty(t.numel + t.numel % 2, dtype=torch.int16, device=device)
        decompress_into(t, out, table)
        return out[: t.numel].view(torch.bfloat16).view(t.shape)
    out = torch.empty(t.numel, dtype=torch.int16)
    decompress_into(t.to(torch.device("cpu")), out, table)
    return out.view(torch.bfloat16).view(t.shape).to(device)


def decompress_verified(t: CompressedTensor, device: torch.device) -> torch.Tensor:
    """decompress_on, then the decoded bits checked against the original's checksum."""
    tensor = decompress_on(t, device)
    verify_output(t, tensor.view(torch.int16))
    return tensor
