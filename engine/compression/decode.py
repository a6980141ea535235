"""Decoding on a device: the Triton kernel on CUDA (when triton is there); on the CPU the native
decoder, or the torch decoder where the native extension was not built (said once in the log)."""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from engine.compression.checkpoint import verify_output
from engine.compression.format import CompressedTensor
from engine.compression.tables import pair_table

log = logging.getLogger(__name__)
_fallback_logged = False


def uses_kernel(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    from engine import kernels
    return kernels.available()


def cpu_decoder() -> ModuleType:
    """native_decoder when its extension is built, else torch_decoder. Both have
    decode_chunks(t, out, first, last, table=None)."""
    global _fallback_logged
    from engine.compression import native_decoder, torch_decoder
    if native_decoder.available():
        return native_decoder
    if not _fallback_logged:
        _fallback_logged = True
        log.warning("the native BF16 decoder is not built (%s): compressed weights decode on the CPU with the torch "
                    "decoder, about 5x slower; reinstall with a C compiler present (pip install -e .)",
                    native_decoder.MISSING)
    return torch_decoder


def needs_pair_tables(device: torch.device) -> bool:
    """Whether decoding on device reads tables.py's pair table (the Triton kernel, the torch fallback):
    callers that decode the same tensors again and again then build it once. The native decoder
    builds its own in microseconds."""
    from engine.compression import native_decoder
    return device.type != "cpu" or cpu_decoder() is not native_decoder


def decompress_into(t: CompressedTensor, out: torch.Tensor, table: torch.Tensor | None = None,
                    decoder: ModuleType | None = None) -> None:
    """Decode t into out (int16, contiguous; on t's device). On CUDA out needs t.numel rounded up to
    even elements and table (pair_table, on the device); decoder: a CPU decoder module (cpu_decoder())."""
    if out.device.type == "cuda":
        from engine.compression import triton_decoder
        triton_decoder.decompress_into(t, out, table)
        return
    if out.dtype != torch.int16 or out.numel() < t.numel or not out.is_contiguous():
        raise ValueError(f"decoding {t.name!r} needs a contiguous int16 vector of {t.numel} elements, "
                         f"got {out.dtype} {tuple(out.shape)}")
    (decoder or cpu_decoder()).decode_chunks(t, out[: t.numel], 0, t.num_chunks, table)


def decompress(t: CompressedTensor, decoder: ModuleType | None = None) -> torch.Tensor:
    """The original bf16 tensor, decoded on the CPU."""
    out = torch.empty(t.numel, dtype=torch.int16)
    decompress_into(t, out, decoder=decoder)
    return out.view(torch.bfloat16).view(t.shape)


def decompress_rows(t: CompressedTensor, start: int, stop: int, decoder: ModuleType | None = None) -> torch.Tensor:
    """Rows start .. stop-1 (first dimension) of the original bf16 tensor, decoded on the CPU from only
    the chunks that hold them: how one tensor-parallel rank reads its shard of a row-split weight."""
    if not t.shape or not 0 <= start <= stop <= t.shape[0]:
        raise ValueError(f"rows {start}:{stop} are outside tensor {t.name!r} of shape {t.shape}")
    row = t.numel // t.shape[0] if t.shape[0] else 0
    begin, end = start * row, stop * row
    if begin == end:
        return torch.empty(stop - start, *t.shape[1:], dtype=torch.bfloat16)
    first, last = begin // t.chunk_size, -(-end // t.chunk_size)
    origin = first * t.chunk_size
    out = torch.empty(min(t.numel, last * t.chunk_size) - origin, dtype=torch.int16)
    (decoder or cpu_decoder()).decode_chunks(t, out, first, last)
    return out[begin - origin: end - origin].view(torch.bfloat16).view(stop - start, *t.shape[1:])


def decompress_on(t: CompressedTensor, device: torch.device) -> torch.Tensor:
    """The original bf16 tensor on device, decoded there when a kernel can."""
    if uses_kernel(device):
        t = t.to(device)
        table = pair_table(t.palette, t.code_lengths).to(device)
        out = torch.empty(t.numel + t.numel % 2, dtype=torch.int16, device=device)
        decompress_into(t, out, table)
        return out[: t.numel].view(torch.bfloat16).view(t.shape)
    return decompress(t.to(torch.device("cpu"))).to(device)


def decompress_verified(t: CompressedTensor, device: torch.device) -> torch.Tensor:
    """decompress_on, then the decoded bits checked against the original's checksum."""
    tensor = decompress_on(t, device)
    verify_output(t, tensor.view(torch.int16))
    return tensor
