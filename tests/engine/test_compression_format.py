"""The compressed tensor format: bit-exact round trips through both CPU decoders (native and torch),
code construction, and rejected corruption."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.compression_cases import cases
from engine.compression import native_decoder, torch_decoder
from engine.compression.codes import MAX_CODE_LENGTH, canonical_codes, code_lengths, kraft_ok
from engine.compression.decode import decompress, decompress_rows
from engine.compression.encoder import compress_tensor
from engine.compression.format import GROUP_SIZE, CompressedFormatError, validate

CASES = cases()
DECODERS = {"native": native_decoder, "torch": torch_decoder}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int16)


@pytest.mark.parametrize("decoder", list(DECODERS))
@pytest.mark.parametrize("chunk_size", [None, 64])   # None: 256 for these sizes
@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_is_bit_exact(name, chunk_size, decoder):
    original = CASES[name]
    compressed = compress_tensor(name, original, chunk_size)
    if compressed is None:
        # Only tensors that cannot shrink stay plain: the all-escape case, and a handful of elements.
        assert name in ("escapes-everywhere", "tiny", "one-element")
        return
    validate(compressed)
    restored = decompress(compressed, DECODERS[decoder])
    assert restored.shape == original.shape and restored.dtype == torch.bfloat16
    assert torch.equal(bits(restored), bits(original))
    assert compressed.nbytes < 2 * original.numel()


@pytest.mark.parametrize("decoder", list(DECODERS))
@pytest.mark.parametrize("rows", [(0, 96), (0, 1), (5, 6), (31, 77), (95, 96), (40, 40)])
def test_a_row_range_decodes_only_its_chunks_bit_exactly(rows, decoder):
    original = CASES["normal-0.02"].clone()   # 96 rows of 200: chunks of 64 straddle rows
    original[50, 3] = 1e-38   # an escape group inside the range of some cases
    compressed = compress_tensor("w", original, 64)
    start, stop = rows
    assert torch.equal(bits(decompress_rows(compressed, start, stop, DECODERS[decoder])), bits(original[start:stop]))


def test_escape_groups_are_only_where_rare_exponents_are():
    compressed = compress_tensor("x", CASES["escapes-some"], 64)
    assert compressed.escape_groups.tolist() == [100 // GROUP_SIZE, 139 // GROUP_SIZE]


def test_normal_weights_shrink_by_about_a_third():
    weights = (torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    compressed = compress_tensor("w", weights, 1024)   # the chunk size tensors of real models get
    assert compressed.escape_groups.numel() < 0.02 * compressed.num_groups   # the far tail of tiny weights
    assert 0.30 < 1 - compressed.nbytes / (2 * weights.numel()) < 0.36


def test_code_lengths_are_limited_and_optimal_for_small_alphabets():
    counts = [1000, 1] + [1] * 14           # unlimited Huffman would give the rare symbols 15 bits
    lengths = code_lengths(counts)
    assert max(lengths) <= MAX_CODE_LENGTH and kraft_ok(lengths)
    for counts in ([5, 3, 2, 1], [1, 1, 1], [7, 7, 1, 1, 1]):  # brute force over all prefix codes
        best = min(sum(c * n for c, n in zip(counts, ls))
                   for ls in itertools.product(range(1, 5), repeat=len(counts)) if kraft_ok(list(ls)))
        assert sum(c * n for c, n in zip(counts, code_lengths(counts))) == best
    assert code_lengths([42]) == [1]


def test_canonical_codes_are_a_prefix_code():
    lengths = [3, 2, 4, 2, 4, 3, 3]
    codes = canonical_codes(lengths)
    words = [format(c, f"0{n}b") for c, n in zip(codes, lengths)]
    assert words == ["100", "00", "1110", "01", "1111", "101", "110"]
    assert not any(a != b and b.startswith(a) for a in words for b in words)


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.exponent_stream.__setitem__(3, t.exponent_stream[3] ^ 0x10), "payload checksum"),
    (lambda t: t.sign_mantissa.__setitem__(0, t.sign_mantissa[0] ^ 1), "payload checksum"),
    (lambda t: t.palette.__setitem__(1, t.palette[0]), "repeats an exponent"),
    (lambda t: t.code_lengths.fill_(1), "not a prefix code"),
    (lambda t: setattr(t, "chunk_offsets", t.chunk_offsets[:-1]), "chunk_offsets"),
    (lambda t: setattr(t, "sign_mantissa", t.sign_mantissa[:-5]), "sign_mantissa"),
    (lambda t: t.escape_exponents.copy_(t.palette[0].expand_as(t.escape_exponents)), "palette and the escape table disagree"),
    (lambda t: t.escape_groups.__setitem__(0, 10_000), "escape_groups"),
])
def test_corruption_is_rejected_naming_the_tensor(damage, message):
    compressed = compress_tensor("model.layers.0.mlp.up_proj.weight", CASES["escapes-some"], 64)
    damage(compressed)
    with pytest.raises(CompressedFormatError, match=f"'model.layers.0.mlp.up_proj.weight'.*{message}"):
        validate(compressed)
