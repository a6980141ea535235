"""Decode tables built from a tensor's palette and code lengths, shared by the torch and Triton decoders.

Both decoders read a 16-bit window of the stream and take two symbols at once: with codes of at
most 8 bits, the first 16 bits after any code boundary always hold two whole codes. `pair[w]` holds
the two symbols' exponents already in place for a bf16 (exponent << 7; the first symbol in the low
16 bits) and, in bits 0-4 (which an exponent in place never uses), their total code length. One
gather gives both; the decoders mask the length off before merging the sign and mantissa.
"""

from __future__ import annotations

import torch

from engine.compression.codes import MAX_CODE_LENGTH, canonical_codes

assert 2 * MAX_CODE_LENGTH <= 16, "the pair table reads 16-bit windows"


EXPONENT_BITS = 0x7F807F80   # the two exponents of a pair entry; bits 0-4 are the length
LENGTH_BITS = 0x1F


def single_tables(code_lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(symbol, length) of the code an 8-bit window starts with. Windows no code starts (an incomplete
    code's unused space: only reachable past a chunk's last code) give symbol 0, length 8."""
    symbol = torch.zeros(256, dtype=torch.int64)
    length = torch.full((256,), MAX_CODE_LENGTH, dtype=torch.int64)
    for s, (n, code) in enumerate(zip(code_lengths, canonical_codes(code_lengths))):
        first = code << (MAX_CODE_LENGTH - n)
        symbol[first: first + (1 << (MAX_CODE_LENGTH - n))] = s
        length[first: first + (1 << (MAX_CODE_LENGTH - n))] = n
    return symbol, length


def pair_table(palette: torch.Tensor, code_lengths: torch.Tensor) -> torch.Tensor:
    """int32 [65536], indexed by the next 16 stream bits."""
    symbol, length = single_tables(code_lengths.tolist())
    window = torch.arange(1 << 16, dtype=torch.int64)
    first = window >> 8
    s1, n1 = symbol[first], length[first]
    second = (window << n1 >> 8) & 0xFF
    s2, n2 = symbol[second], length[second]
    exp16 = palette.cpu().to(torch.int64) << 7
    pair = exp16[s1] | (exp16[s2] << 16)
    return (pair | (n1 + n2)).to(torch.int32)
