"""BF16 tensor -> CompressedTensor: palette of frequent exponents, escape groups, canonical Huffman stream.

Vectorized torch over blocks of 2^18 elements (whole chunks and groups): temporaries stay a few MiB,
so the allocator reuses them instead of faulting fresh pages for every op, and memory stays bounded
on multi-GB tensors. Three passes: exponent histogram (palette), symbols and escape groups (code
lengths need the counts), then the bit packing.
"""

from __future__ import annotations

import torch

from engine.compression.codes import MAX_CODE_LENGTH, canonical_codes, code_lengths
from engine.compression.format import (DEFAULT_CHUNK_SIZE, GROUP_SIZE, MAX_CHUNK_SIZE, PALETTE_SIZE,
                                       CompressedTensor, tensor_checksum)

BLOCK_ELEMENTS = MAX_CHUNK_SIZE   # elements per pass: whole chunks and groups
MIN_LANES = 4096         # auto chunk size: enough chunks that a lockstep decode amortizes its per-op overhead
MIN_AUTO_CHUNK_SIZE = 256   # below this the chunk index (8 bytes a chunk) costs more than 1/4 bit an element


def auto_chunk_size(numel: int) -> int:
    """DEFAULT_CHUNK_SIZE for large tensors; smaller chunks (down to 256) for small ones, so they
    decode as more lanes walking fewer steps."""
    size = DEFAULT_CHUNK_SIZE
    while size > MIN_AUTO_CHUNK_SIZE and numel < size * MIN_LANES:
        size //= 2
    return size


def split_bf16(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exponent, sign << 7 | mantissa) bytes of bf16 bit patterns held in an int16 tensor."""
    exponent = ((bits >> 7) & 0xFF).to(torch.uint8)
    sign_mantissa = (((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)
    return exponent, sign_mantissa


def compress_tensor(name: str, tensor: torch.Tensor, chunk_size: int | None = None) -> CompressedTensor | None:
    """The compressed form of a bf16 tensor, or None when it would not be smaller than the tensor.
    chunk_size None: auto_chunk_size."""
    if tensor.dtype != torch.bfloat16:
        raise ValueError(f"{name}: only bfloat16 tensors are compressed, got {tensor.dtype}")
    chunk_size = chunk_size or auto_chunk_size(tensor.numel())
    if chunk_size % GROUP_SIZE or chunk_size > MAX_CHUNK_SIZE or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, a multiple of {GROUP_SIZE}, at most {MAX_CHUNK_SIZE}")
    bits = tensor.detach().cpu().contiguous().view(-1).view(torch.int16)
    n = bits.numel()
    if n == 0:
        return None
    blocks = [(start, min(n, start + BLOCK_ELEMENTS)) for start in range(0, n, BLOCK_ELEMENTS)]
    hist = torch.zeros(256, dtype=torch.int64)
    for start, stop in blocks:
        hist += torch.bincount(((bits[start:stop] >> 7) & 0xFF).to(torch.uint8), minlength=256)
    palette = _palette(hist)
    symbols, sign_mantissa, escape_groups, escape_exponents, counts = _symbols(bits, palette, blocks)
    used = counts > 0   # a palette exponent seen only in escape groups gets no code
    if not used.all():
        palette, counts = palette[used], counts[used]
        symbols = torch.index_select((torch.cumsum(used, 0) - 1).to(torch.uint8), 0, symbols.to(torch.int32))
    lengths = code_lengths(counts.tolist(), MAX_CODE_LENGTH)
    stream, offsets = _pack(symbols, lengths, canonical_codes(lengths), chunk_size, blocks)
    compressed = CompressedTensor(
        name=name, shape=tuple(tensor.shape), chunk_size=chunk_size, palette=palette.to(torch.uint8),
        code_lengths=torch.tensor(lengths, dtype=torch.uint8), chunk_offsets=offsets, exponent_stream=stream,
        sign_mantissa=sign_mantissa, escape_groups=escape_groups, escape_exponents=escape_exponents,
        xxh3=tensor_checksum(bits)).seal()
    return compressed if compressed.nbytes < 2 * n else None


def _palette(hist: torch.Tensor) -> torch.Tensor:
    """The most frequent exponents, most frequent first (ties: the smaller exponent)."""
    order = torch.argsort(hist, descending=True, stable=True)[:PALETTE_SIZE]
    return order[hist[order] > 0]


def _symbols(bits: torch.Tensor, palette: torch.Tensor, blocks: list[tuple[int, int]]):
    """Per element: its palette index (uint8; 0 in escape groups) and sign/mantissa byte; the escape
    groups with their exponents; and each palette entry's count of coded symbols."""
    n = bits.numel()
    symbol_of = torch.full((256,), PALETTE_SIZE, dtype=torch.uint8)   # PALETTE_SIZE marks an escape
    symbol_of[palette.long()] = torch.arange(palette.numel(), dtype=torch.uint8)
    symbols = torch.empty(n, dtype=torch.uint8)
    sign_mantissa = torch.empty(n, dtype=torch.uint8)
    counts = torch.zeros(PALETTE_SIZE + 1, dtype=torch.int64)
    escape_groups, escape_exponents = [], []
    for start, stop in blocks:
        exponent, sign_mantissa[start:stop] = split_bf16(bits[start:stop])
        block = torch.index_select(symbol_of, 0, exponent.to(torch.int32))
        num_groups = -(-(stop - start) // GROUP_SIZE)
        grouped = torch.zeros(num_groups * GROUP_SIZE, dtype=torch.uint8)
        grouped[: stop - start] = block
        escaped = torch.nonzero(grouped.view(num_groups, GROUP_SIZE).amax(dim=1) == PALETTE_SIZE).view(-1)
        if escaped.numel():
            padded = torch.zeros(num_groups * GROUP_SIZE, dtype=torch.uint8)
            padded[: stop - start] = exponent
            escape_exponents.append(padded.view(num_groups, GROUP_SIZE)[escaped])
            escape_groups.append(escaped + start // GROUP_SIZE)
            grouped.view(num_groups, GROUP_SIZE)[escaped] = 0   # decoders overwrite escape groups
            block = grouped[: stop - start]
        symbols[start:stop] = block
        counts += torch.bincount(block, minlength=PALETTE_SIZE + 1)
    groups = torch.cat(escape_groups) if escape_groups else torch.zeros(0, dtype=torch.int64)
    exponents = torch.cat(escape_exponents) if escape_exponents else torch.zeros(0, GROUP_SIZE, dtype=torch.uint8)
    return symbols, sign_mantissa, groups, exponents, counts[: palette.numel()]


def _pack(symbols: torch.Tensor, lengths: list[int], codes: list[int], chunk_size: int,
          blocks: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical codes, most significant bit first, in 16-bit words; every chunk starts a new word.
    Returns (stream int16 [words], chunk_offsets int64 [chunks + 1] in words)."""
    # One lookup gives both: the code in bits 0-7 and its length in bits 8-11.
    code_and_length = torch.tensor([c | (n_bits << 8) for c, n_bits in zip(codes, lengths)], dtype=torch.int32)
    streams, chunk_words = [], []
    for start, stop in blocks:
        block = torch.index_select(code_and_length, 0, symbols[start:stop].to(torch.int32))
        count = stop - start
        num_chunks = -(-count // chunk_size)
        length = block >> 8
        end_bit = torch.cumsum(length, 0, dtype=torch.int32)
        chunk_end = end_bit[chunk_size - 1:: chunk_size]
        if chunk_end.numel() < num_chunks:
            chunk_end = torch.cat([chunk_end, end_bit[-1:]])
        chunk_bits = torch.diff(chunk_end, prepend=torch.zeros(1, dtype=torch.int32))
        words = (chunk_bits + 15) >> 4
        # Move each chunk's bits from where the running sum put them to its own word boundary.
        shift = (torch.cumsum(words, 0, dtype=torch.int32) - words) * 16 - (chunk_end - chunk_bits)
        bit = torch.zeros(num_chunks * chunk_size, dtype=torch.int32)
        torch.sub(end_bit, length, out=bit[:count])
        bit.view(num_chunks, chunk_size).add_(shift[:, None])
        bit = bit[:count]
        # A code of at most 8 bits touches at most two words: add its high and low word parts.
        value = (block & 0xFF).to(torch.int64) << (32 - length - (bit & 15))
        word = (bit >> 4).to(torch.int64)
        total = int(words.sum())
        acc = torch.zeros(total + 1, dtype=torch.int64)
        acc.index_add_(0, word, value >> 16)
        acc.index_add_(0, word + 1, value & 0xFFFF)
        streams.append(acc[:total].to(torch.int32).to(torch.int16))
        chunk_words.append(words.to(torch.int64))
    offsets = torch.zeros(1 + sum(w.numel() for w in chunk_words), dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.cat(chunk_words), 0)
    return torch.cat(streams), offsets
