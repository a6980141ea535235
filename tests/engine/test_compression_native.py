"""The native CPU decoder: built by the install, bit-exact to the torch decoder on long chunks and split
over threads, and safe on corrupt input (a clear error naming the tensor, never a crash)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from engine.compression import decode, native_decoder, torch_decoder, workers
from engine.compression.encoder import compress_tensor
from engine.compression.format import CompressedFormatError, CompressedTensor
from tests.compression_cases import cases

NAME = "model.layers.2.mlp.gate_proj.weight"


def weights(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Normal weights with a few rare exponents: escape groups among ordinary ones."""
    values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02
    values.view(-1)[::9973] = 1e-30
    return values.to(torch.bfloat16)


def decoded(t: CompressedTensor, decoder) -> torch.Tensor:
    out = torch.full((t.numel,), 0x5555, dtype=torch.int16)
    decode.decompress_into(t, out, decoder=decoder)
    return out


def test_the_native_decoder_is_built():
    assert native_decoder.available(), (
        f"engine.compression._native is missing ({native_decoder.MISSING}): `make install` (pip install -e .) builds "
        f"it with the C compiler")
    assert decode.cpu_decoder() is native_decoder


@pytest.mark.parametrize("chunk_size", [1024, 4096])
def test_long_chunks_with_an_odd_short_last_chunk_decode_bit_exactly(chunk_size):
    """Chunks of several merge segments, most decoded side by side, the last ones with checked reads.
    (The torch decoder matches the same originals in test_compression_format.py.)"""
    original = weights(257, 511)   # 131327 elements: the last chunk is short and odd
    t = compress_tensor(NAME, original, chunk_size)
    assert t.escape_groups.numel() > 0
    assert torch.equal(decoded(t, native_decoder), original.view(-1).view(torch.int16))


def test_chunk_ranges_split_over_threads_decode_bit_exactly(monkeypatch):
    monkeypatch.setattr(native_decoder, "MIN_PIECE_ELEMENTS", 1000)
    monkeypatch.setattr(workers, "num_workers", lambda: 3)
    original = weights(96, 640, seed=1)
    t = compress_tensor(NAME, original, 256)
    assert torch.equal(decoded(t, native_decoder), original.view(-1).view(torch.int16))
    rows = decode.decompress_rows(t, 17, 83, native_decoder)
    assert torch.equal(rows.view(torch.int16), original[17:83].view(torch.int16))


def _offsets_too_long(t):
    t.chunk_offsets[3:] += t.chunk_size   # chunk 2 claims more words than chunk_size / 2


def _stream_truncated(t):
    t.exponent_stream = t.exponent_stream[:-40]


def _garbage_codes(t):
    t.exponent_stream.fill_(-1)   # all ones: long codes, more bits than the chunks' words hold


CORRUPTIONS = [
    (lambda t: t.chunk_offsets.__setitem__(5, 1 << 40), "chunk_offsets of chunk 4"),
    (lambda t: t.chunk_offsets.__setitem__(5, -3), "chunk_offsets of chunk 4"),
    (_offsets_too_long, "chunk_offsets of chunk 2"),
    (_stream_truncated, "outside the .*-word stream"),
    (lambda t: setattr(t, "chunk_offsets", t.chunk_offsets[:-1]), "chunk_offsets holds"),
    (_garbage_codes, "run past its"),
    (lambda t: t.escape_groups.__setitem__(0, 1 << 50), "escape group"),
    (lambda t: t.escape_groups.__setitem__(0, -1), "escape group"),
    (lambda t: setattr(t, "escape_exponents", t.escape_exponents[:-1]), "escape_exponents holds"),
    (lambda t: setattr(t, "sign_mantissa", t.sign_mantissa[:-1]), "sign_mantissa holds"),
    (lambda t: t.palette.__setitem__(1, t.palette[0]), "repeats exponent"),
    (lambda t: t.code_lengths.__setitem__(0, 9), "code length 9"),
    (lambda t: t.code_lengths.fill_(1), "not a prefix code"),
    (lambda t: setattr(t, "code_lengths", t.code_lengths[:-1]), "code_lengths"),
    (lambda t: setattr(t, "palette", torch.arange(17, dtype=torch.uint8)), "17 entries"),
    (lambda t: setattr(t, "chunk_size", 100), "chunk_size 100"),
]


@pytest.mark.parametrize("damage, message", CORRUPTIONS)
def test_corrupt_parts_reaching_the_native_decoder_raise_naming_the_tensor(damage, message):
    """Damage that format.validate would catch first, handed to the C code directly: it checks for itself."""
    t = compress_tensor(NAME, cases()["escapes-some"], 64)
    damage(t)
    out = torch.empty(t.numel, dtype=torch.int16)
    with pytest.raises(CompressedFormatError, match=f"'{NAME}'.*{message}"):
        native_decoder.decode_chunks(t, out, 0, t.num_chunks)


def test_random_damage_never_crashes_the_native_decoder():
    """Random offsets, stream words and escape indices: each decode raises the format error or finishes
    (the checksum then catches wrong bits); it never reads or writes out of bounds."""
    clean = compress_tensor(NAME, weights(64, 300, seed=2), 64)
    generator = torch.Generator().manual_seed(5)
    raised = 0
    for trial in range(300):
        t = dataclasses.replace(clean, **{name: part.clone() for name, part in clean.parts().items()})
        part = [t.chunk_offsets, t.exponent_stream, t.escape_groups][trial % 3]
        where = torch.randint(0, part.numel(), (3,), generator=generator)
        part[where] = torch.randint(-(1 << 15), 1 << 15, (3,), generator=generator).to(part.dtype)
        out = torch.empty(t.numel, dtype=torch.int16)
        try:
            native_decoder.decode_chunks(t, out, 0, t.num_chunks)
        except CompressedFormatError:
            raised += 1
    assert raised > 100   # most damage to offsets and escape indices is caught before or while decoding


def test_without_the_extension_the_cpu_decodes_with_the_torch_decoder_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(native_decoder, "_native", None)
    monkeypatch.setattr(decode, "_fallback_logged", False)
    original = weights(40, 100)
    t = compress_tensor(NAME, original, 64)
    with caplog.at_level(logging.WARNING, logger="engine.compression.decode"):
        assert torch.equal(decode.decompress(t).view(torch.int16), original.view(torch.int16))
        decode.decompress(t)
    assert decode.cpu_decoder() is torch_decoder
    said = [r.getMessage() for r in caplog.records if "native BF16 decoder is not built" in r.getMessage()]
    assert len(said) == 1 and "torch decoder" in said[0]
