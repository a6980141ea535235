"""The Triton decoder: the torch decoder's lockstep scheme as one GPU kernel (used on CUDA).

One program decodes LANES chunks side by side; each lane walks its chunk two symbols a step (a
16-bit window from two stream words, one pair-table load) and writes the two finished bf16 values
as one 32-bit store, the sign/mantissa bytes merged in registers. Nothing is staged in memory
between steps, so the kernel reads the compressed bytes once and writes the output once. The
escape groups are patched afterwards with torch ops, like on the CPU.

Not yet run on a GPU: tests check it bit-exact against the torch decoder under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.compression.format import CompressedTensor

LANES = 128   # chunks per program: one per thread of a 4-warp program


@triton.jit
def _decode_kernel(stream_ptr, offsets_ptr, table_ptr, sign_mantissa_ptr, out_ptr, n_elements, num_chunks,
                   stream_words, CHUNK: tl.constexpr, LANES: tl.constexpr):
    lanes = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = lanes < num_chunks
    bit = tl.load(offsets_ptr + lanes, mask=live, other=0).to(tl.int64) * 16
    first = lanes.to(tl.int64) * CHUNK
    for step in range(CHUNK // 2):
        word = bit >> 4
        high = tl.load(stream_ptr + word, mask=live & (word < stream_words), other=0).to(tl.int32) & 0xFFFF
        low = tl.load(stream_ptr + word + 1, mask=live & (word + 1 < stream_words), other=0).to(tl.int32) & 0xFFFF
        window = (((high << 16) | low) >> (16 - (bit & 15)).to(tl.int32)) & 0xFFFF
        entry = tl.load(table_ptr + window, mask=live, other=0)
        element = first + 2 * step
        in_tensor = live & (element < n_elements)
        s0 = tl.load(sign_mantissa_ptr + element, mask=in_tensor, other=0).to(tl.int32)
        s1 = tl.load(sign_mantissa_ptr + element + 1, mask=in_tensor & (element + 1 < n_elements), other=0).to(tl.int32)
        # bf16 bits: sign from bit 7 of the byte, mantissa from bits 0-6, exponent from the entry.
        signs_and_mantissas = ((s0 & 0x80) << 8) | (s0 & 0x7F) | ((s1 & 0x80) << 24) | ((s1 & 0x7F) << 16)
        pair = signs_and_mantissas | (entry & 0x7F807F80)   # tables.EXPONENT_BITS
        tl.store(out_ptr + element // 2, pair, mask=in_tensor)
        bit += (entry & 0x1F).to(tl.int64)                   # tables.LENGTH_BITS


def decompress_into(t: CompressedTensor, out: torch.Tensor, table: torch.Tensor) -> None:
    """Decode t (parts and table on out's device) into out, a contiguous int16 vector of t.numel
    elements plus one when t.numel is odd (the kernel writes whole pairs)."""
    from engine.compression.torch_decoder import write_escapes

    if t.numel == 0:
        return
    grid = (triton.cdiv(t.num_chunks, LANES),)
    _decode_kernel[grid](t.exponent_stream, t.chunk_offsets, table, t.sign_mantissa, out.view(torch.int32),
                         t.numel, t.num_chunks, t.exponent_stream.numel(), CHUNK=t.chunk_size, LANES=LANES)
    write_escapes(t, out[: t.numel])
