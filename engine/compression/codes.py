"""The exponent code: length-limited Huffman code lengths (encoder) and canonical codes (both sides).

The format stores only each palette symbol's code length; both the encoder and every decoder derive
the codes from the lengths in the same canonical order (FORMAT.md, "Code").
"""

from __future__ import annotations

MAX_CODE_LENGTH = 8   # one 16-bit window always holds two whole codes: the CPU decoder's two-symbol lookup


def code_lengths(counts: list[int], max_length: int = MAX_CODE_LENGTH) -> list[int]:
    """Optimal prefix-code lengths no longer than max_length for positive symbol counts (package-merge).

    One symbol gets length 1 (a code must spend at least one bit per symbol to mark it).
    """
    if not counts or any(c <= 0 for c in counts):
        raise ValueError(f"counts must be positive, got {counts}")
    if len(counts) > 1 << max_length:
        raise ValueError(f"{len(counts)} symbols do not fit codes of at most {max_length} bits")
    if len(counts) == 1:
        return [1]
    leaves = sorted((count, (symbol,)) for symbol, count in enumerate(counts))
    merged = list(leaves)
    for _ in range(max_length - 1):
        packages = [(merged[i][0] + merged[i + 1][0], merged[i][1] + merged[i + 1][1])
                    for i in range(0, len(merged) - 1, 2)]
        merged = sorted(leaves + packages, key=lambda item: item[0])
    lengths = [0] * len(counts)
    for _, symbols in merged[: 2 * len(counts) - 2]:
        for symbol in symbols:
            lengths[symbol] += 1
    return lengths


def kraft_ok(lengths: list[int], max_length: int = MAX_CODE_LENGTH) -> bool:
    """True when the lengths are in [1, max_length] and a prefix code with them exists."""
    if not lengths or any(not 1 <= n <= max_length for n in lengths):
        return False
    return sum(1 << (max_length - n) for n in lengths) <= 1 << max_length


def canonical_codes(lengths: list[int]) -> list[int]:
    """The canonical code of each symbol: symbols in (length, index) order take consecutive codes,
    the first is all zeros, and each next code is (previous + 1) shifted left by the length step."""
    order = sorted(range(len(lengths)), key=lambda s: (lengths[s], s))
    codes = [0] * len(lengths)
    code, previous = 0, lengths[order[0]]
    for rank, symbol in enumerate(order):
        if rank:
            code = (code + 1) << (lengths[symbol] - previous)
        codes[symbol] = code
        previous = lengths[symbol]
    return codes
