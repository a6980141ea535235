"""The native CPU decoder: FORMAT.md v1 decoded by a small C loop (native_decoder.c), the CPU's default.

Why C. The torch decoder runs all chunks in lockstep, 8 torch ops per two symbols; every op reads
and writes whole lane arrays, so it is bound by that memory traffic at about 0.4 GB/s of bf16
output per CPU-second, and the issue asks for 1 GB/s. The C loop keeps each chunk's bit position in
a register, does one pair-table lookup per two symbols and writes each output byte once, merging
the sign/mantissa bytes while the output is still in L1. Measured on the project's 2-core AMD EPYC
(Zen 4) VM under load, one thread, 4096 x 1024 normal weights, CPU time of the decoding thread:
torch decoder 0.37-0.40 GB/s per CPU-second, this one 2.2-2.7. Walking 8 chunks side by side is
what makes it fast (1 chunk at a time: 0.53; 4: 1.5; 8: 2.3; 16 runs out of registers: 1.6), and
the 64K-entry pair table beats a 256-entry one-symbol table that fits L1 (1.3): one lookup per two
symbols halves each chunk's dependency chain. torch.compile and numba were not measured: the first
needs a C++ toolchain and a compile step at run time, the second a new dependency, and plain C
built once by `pip install -e .` already clears the target by 2x on one core.

The extension is built by the editable install (pyproject.toml, optional). Where it is missing
(no C compiler), `decode.cpu_decoder()` falls back to the torch decoder and logs one line.

The C code checks every size, offset, code and escape index it reads, so a corrupt tensor raises
a CompressedFormatError naming it, never an out-of-bounds access; the decoded bits are still
checked against the tensor's checksum by the callers that decode whole tensors.
"""

from __future__ import annotations

import torch

from engine.compression import workers
from engine.compression.format import CompressedTensor, corrupt

try:
    from engine.compression import _native
    MISSING = ""
except ImportError as exc:   # not built: decode.cpu_decoder falls back to the torch decoder
    _native = None
    MISSING = str(exc)

MIN_PIECE_ELEMENTS = 1 << 18   # a thread hand-off costs tens of microseconds: smaller work stays on one thread
_INPUT_PARTS = ("exponent_stream", "chunk_offsets", "palette", "code_lengths", "sign_mantissa", "escape_groups",
                "escape_exponents")


def available() -> bool:
    return _native is not None


def decode_chunks(t: CompressedTensor, out: torch.Tensor, first: int, last: int,
                  table: torch.Tensor | None = None) -> None:
    """Chunks first .. last-1 into out (contiguous int16 on the CPU), whose element 0 is the first
    chunk's first element. table is accepted for the torch decoder's signature; this decoder builds
    its own from the palette and code lengths (microseconds, in C)."""
    if last <= first:
        return
    if _native is None:
        raise RuntimeError(f"the native BF16 decoder is not built ({MISSING}); reinstall with a C compiler")
    needed = min(t.numel, last * t.chunk_size) - first * t.chunk_size
    if out.dtype != torch.int16 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() < needed:
        raise ValueError(f"decoding {t.name!r} needs a contiguous int16 CPU tensor of {needed} elements, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    parts = [_aligned(getattr(t, name)).numpy() for name in _INPUT_PARTS]
    target = out.numpy()
    origin = first * t.chunk_size
    num_pieces = max(1, min(workers.num_workers(), needed // MIN_PIECE_ELEMENTS, last - first))
    bounds = [first + (last - first) * i // num_pieces for i in range(num_pieces + 1)]

    def decode(a: int, b: int) -> None:
        _native.decode(*parts, target, t.numel, t.chunk_size, a, b, origin)

    try:
        workers.run(decode, list(zip(bounds, bounds[1:])))
    except ValueError as exc:
        raise corrupt(t.name, str(exc)) from exc


def _aligned(part: torch.Tensor) -> torch.Tensor:
    """The part as a contiguous CPU tensor at an address aligned to its element size (the C code
    reads whole elements; a tensor sliced out of a file need not be aligned)."""
    part = part.contiguous()
    return part if part.data_ptr() % part.element_size() == 0 else part.clone()
