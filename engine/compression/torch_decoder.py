"""The vectorized torch decoder: the CPU fallback, and the reference the other decoders are tested against.

Chunks are independent, so all chunks of a block are decoded in lockstep as lanes: each step reads
every lane's next 16 stream bits (one gather of a 32-bit window, one shift, one mask), looks up two
symbols and their code length in the pair table (256 KiB, stays in L2), stores the entry and
advances: 8 torch ops per step for two symbols of thousands of lanes, so per-op overhead is
amortized and nothing runs per symbol in Python. The entries hold the exponents already in bf16
position; after the loop one blocked transpose puts them in element order and two masks and an
OR with the sign/mantissa bytes (sign-extended to 16 bits) give the bf16 bits. Blocks of lanes
run on the decode threads (workers.py; torch ops release the GIL).

Each op reads and writes whole lane arrays, so the loop is bound by that memory traffic: about
0.4 GB/s of output per CPU-second. The CPU uses the native decoder (native_decoder.py) when it was
built; this one is the fallback and the reference the other decoders are tested against.

Bit bookkeeping: a lane keeps q = K - p, p its bit position in the block's stream and
K = 16 * windows - 1. Then q >> 4 indexes the reversed window array and q & 15 is the shift,
with no subtraction per step; advancing is q -= length.
"""

from __future__ import annotations

import threading

import torch

from engine.compression import workers
from engine.compression.format import GROUP_SIZE, CompressedTensor
from engine.compression.tables import LENGTH_BITS, pair_table

# Chunks decoded together. Measured on a 2-core CPU (chunk 1024): 2048 lanes pay per-op overhead
# (0.30 GB/s a thread for the loop), 8192 amortize it (0.54 GB/s); more spill the L2.
LANES_PER_BLOCK = 8192
BLOCK_ELEMENTS = 1 << 24       # at most per block, so bit positions fit int32 and scratch stays bounded
SIGN_MANTISSA_BITS = -0x7F81   # 0x807F as int16
EXPONENT_MASK = 0x7F80         # drops the code length the pair entries carry in bits 0-4
MERGE_ELEMENTS = 1 << 18       # sign/mantissa bytes widened per pass: a temporary that stays in cache
_local = threading.local()


def _workspace(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-thread scratch tensor kept between calls: a fresh multi-MiB tensor per block would fault
    in new pages on every decode, which costs as much as the decoding itself."""
    buffers = _local.__dict__.setdefault("buffers", {})
    buffer = buffers.get(name)
    if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
        buffer = buffers[name] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


def decode_chunks(t: CompressedTensor, out: torch.Tensor, first: int, last: int,
                  table: torch.Tensor | None = None) -> None:
    """Chunks first .. last-1 into out (contiguous int16), whose element 0 is the first chunk's first
    element. table: pair_table(t.palette, t.code_lengths), for callers that decode the same tensor often."""
    if last <= first:
        return
    table = pair_table(t.palette, t.code_lengths) if table is None else table
    per_block = min(LANES_PER_BLOCK, max(256, -(-(last - first) // workers.num_workers())))
    per_block = max(1, min(per_block, BLOCK_ELEMENTS // t.chunk_size))
    origin = first * t.chunk_size
    workers.run(_decode_block, [(t, table, out, c, min(last, c + per_block), origin)
                                for c in range(first, last, per_block)])
    write_escapes(t, out, origin)


def _decode_block(t: CompressedTensor, table: torch.Tensor, out: torch.Tensor, first: int, last: int,
                  origin: int) -> None:
    lanes, steps = last - first, t.chunk_size // 2
    offsets = t.chunk_offsets[first: last + 1]
    base = int(offsets[0])
    windows = _reversed_windows(t.exponent_stream[base: int(offsets[-1])], t.chunk_size)
    q = (16 * windows.numel() - 1 - 16 * (offsets[:-1] - base)).to(torch.int32)
    entries = _workspace("entries", steps * lanes, torch.int32).view(steps, lanes)
    index = torch.empty(lanes, dtype=torch.int32)
    window = torch.empty(lanes, dtype=torch.int32)
    length = torch.empty(lanes, dtype=torch.int32)
    for step in range(steps):
        torch.bitwise_right_shift(q, 4, out=index)
        torch.index_select(windows, 0, index, out=window)
        torch.bitwise_and(q, 15, out=index)
        window >>= index
        window &= 0xFFFF
        entry = entries[step]
        torch.index_select(table, 0, window, out=entry)
        torch.bitwise_and(entry, LENGTH_BITS, out=length)
        q -= length
    _merge(t, entries, out, first * t.chunk_size, min(t.numel, last * t.chunk_size), origin)


def _merge(t: CompressedTensor, entries: torch.Tensor, out: torch.Tensor, start: int, stop: int, origin: int) -> None:
    """Elements start .. stop-1 (out[i - origin] holds element i) = the entries' exponents in element
    order | the sign/mantissa bits."""
    steps, lanes = entries.shape
    target = out[start - origin: stop - origin]
    if stop - start == lanes * t.chunk_size:
        target.view(torch.int32).view(lanes, steps).copy_(entries.t())   # a blocked transpose
    else:  # the tensor's last chunk is short
        target.copy_(entries.t().contiguous().view(torch.int16).view(-1)[: stop - start])
    widened = _workspace("sign_mantissa", MERGE_ELEMENTS, torch.int16)
    for begin in range(start, stop, MERGE_ELEMENTS):
        end = min(stop, begin + MERGE_ELEMENTS)
        part, wide = out[begin - origin: end - origin], widened[: end - begin]
        wide.copy_(t.sign_mantissa[begin:end].view(torch.int8))   # sign-extends: bit 7 fills bits 7-15
        wide &= SIGN_MANTISSA_BITS
        part &= EXPONENT_MASK
        part |= wide


def _reversed_windows(region: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """int32 [M]: element M-1-j holds stream bits 16j .. 16j+31 (words j and j+1), shifted right once.
    Zero words after the region let a short last chunk's lane run all its steps (8 bits a symbol at most)."""
    padding = chunk_size // 2 + 2
    words = _workspace("words", region.numel() + padding, torch.int32)   # reversed: padding first
    words[:padding].zero_()
    words[padding:].copy_(region.flip(0))
    words &= 0xFFFF
    windows = _workspace("windows", words.numel() - 1, torch.int32)
    torch.bitwise_left_shift(words[1:], 16, out=windows)
    windows |= words[:-1]
    windows >>= 1
    return windows


def write_escapes(t: CompressedTensor, out: torch.Tensor, origin: int = 0) -> None:
    """Patch the escape groups that fall inside out (out[i - origin] holds element i)."""
    if not t.escape_groups.numel():
        return
    index = (t.escape_groups[:, None] * GROUP_SIZE + torch.arange(GROUP_SIZE, device=out.device)).view(-1)
    keep = (index >= origin) & (index < min(t.numel, origin + out.numel()))
    index = index[keep]
    exponent = t.escape_exponents.view(-1)[keep].to(torch.int16)
    sign_mantissa = t.sign_mantissa[index].view(torch.int8).to(torch.int16)
    out[index - origin] = (sign_mantissa & SIGN_MANTISSA_BITS) | (exponent << 7)
