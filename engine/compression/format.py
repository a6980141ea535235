"""One compressed BF16 tensor in memory: its parts, its record, their checks (FORMAT.md is the spec).

A `CompressedTensor` is what the encoder produces, the checkpoint files hold (one safetensors
entry per part, plus a JSON record in the file's metadata) and the decoders read. `validate`
checks every structural rule of the format and the payload checksum, so a decoder is only ever
handed a well-formed tensor; anything else is a CompressedFormatError naming the tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import xxhash

from engine.compression.codes import MAX_CODE_LENGTH, kraft_ok
from engine.errors import CheckpointError

FORMAT_NAME = "edgefire-bf16-exponent-huffman"
# 2: a floating-point vector stored plain may keep its source's dtype (float32 correction biases, norms); every
# other floating tensor is bf16, as in 1. This edgefire writes 2 and reads both.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
GROUP_SIZE = 64          # elements per escape group ("row" of the published design)
PALETTE_SIZE = 16        # most frequent exponents coded per tensor
DEFAULT_CHUNK_SIZE = 1024
MAX_CHUNK_SIZE = 1 << 18
PART_MARKER = ".__efc."  # safetensors name of a part: f"{tensor}{PART_MARKER}{part}"
# Parts in checksum order, with their dtypes.
PARTS = {
    "palette": torch.uint8,
    "code_lengths": torch.uint8,
    "chunk_offsets": torch.int64,
    "exponent_stream": torch.int16,
    "sign_mantissa": torch.uint8,
    "escape_groups": torch.int64,
    "escape_exponents": torch.uint8,
}


class CompressedFormatError(CheckpointError):
    """A compressed tensor breaks the format: corrupt, truncated, or written by another version."""


@dataclass(slots=True)
class CompressedTensor:
    name: str
    shape: tuple[int, ...]
    chunk_size: int
    palette: torch.Tensor           # uint8 [P]: the exponents symbol i stands for
    code_lengths: torch.Tensor      # uint8 [P]: canonical Huffman code length of symbol i
    chunk_offsets: torch.Tensor     # int64 [K + 1]: word where chunk k's codes start; last = stream length
    exponent_stream: torch.Tensor   # int16 [W]: the codes, chunk after chunk, first bit = bit 15 of word 0
    sign_mantissa: torch.Tensor     # uint8 [N]: sign bit << 7 | 7 mantissa bits, per element
    escape_groups: torch.Tensor     # int64 [E]: groups stored verbatim, ascending
    escape_exponents: torch.Tensor  # uint8 [E, GROUP_SIZE]: their exponents
    xxh3: str                       # of the original bf16 bytes
    payload_xxh3: str = ""          # of the record and every part; set by seal()

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def num_chunks(self) -> int:
        return -(-self.numel // self.chunk_size)

    @property
    def num_groups(self) -> int:
        return -(-self.numel // GROUP_SIZE)

    @property
    def nbytes(self) -> int:
        """Bytes of every part: what the tensor costs on disk and in memory."""
        return sum(part.numel() * part.element_size() for part in self.parts().values())

    def parts(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in PARTS}

    def record(self) -> dict:
        """The JSON record stored beside the parts."""
        return {"shape": list(self.shape), "chunk_size": self.chunk_size, "xxh3": self.xxh3,
                "payload_xxh3": self.payload_xxh3}

    def seal(self) -> CompressedTensor:
        self.payload_xxh3 = payload_checksum(self.shape, self.chunk_size, self.xxh3, self.parts())
        return self

    def to(self, device: torch.device) -> CompressedTensor:
        moved = {name: part.to(device) for name, part in self.parts().items()}
        return CompressedTensor(self.name, self.shape, self.chunk_size, **moved, xxh3=self.xxh3,
                                payload_xxh3=self.payload_xxh3)


def corrupt(name: str, problem: str) -> CompressedFormatError:
    """The error for a compressed tensor that breaks the format, naming it and what to do."""
    return CompressedFormatError(f"compressed tensor {name!r}: {problem}; the checkpoint is corrupt or truncated: "
                                 f"compress it again from the original")


def part_name(tensor: str, part: str) -> str:
    return f"{tensor}{PART_MARKER}{part}"


def split_part_name(name: str) -> tuple[str, str] | None:
    """(tensor, part) for a part's safetensors name, None for a plain tensor."""
    tensor, marker, part = name.rpartition(PART_MARKER)
    return (tensor, part) if marker else None


def is_vector(tensor: torch.Tensor) -> bool:
    """Whether a tensor's elements lie along one dimension (or none: a scalar): a vector, also one stored as a
    single row (ERNIE 4.5's correction bias, [1, experts]). compress keeps a floating one in its own dtype."""
    return sum(size > 1 for size in tensor.shape) <= 1


def tensor_checksum(values: torch.Tensor) -> str:
    """xxh3-64 (hex) of a CPU tensor's bytes."""
    return xxhash.xxh3_64_hexdigest(_bytes(values))


def payload_checksum(shape, chunk_size: int, xxh3: str, parts: dict[str, torch.Tensor]) -> str:
    digest = xxhash.xxh3_64()
    header = {"shape": list(shape), "chunk_size": chunk_size, "xxh3": xxh3}
    digest.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    for name in PARTS:
        digest.update(_bytes(parts[name]))
    return digest.hexdigest()


def _bytes(values: torch.Tensor) -> memoryview:
    flat = values.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy())


def from_record(name: str, record: dict, parts: dict[str, torch.Tensor]) -> CompressedTensor:
    """Build and validate a tensor from its stored record and parts."""
    try:
        shape = tuple(int(d) for d in record["shape"])
        chunk_size = int(record["chunk_size"])
        xxh3, payload = str(record["xxh3"]), str(record["payload_xxh3"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CompressedFormatError(f"tensor {name!r}: its record {record!r} is malformed ({exc})") from exc
    missing = [part for part in PARTS if part not in parts]
    if missing:
        raise CompressedFormatError(f"tensor {name!r}: parts {missing} are missing from the checkpoint")
    tensor = CompressedTensor(name, shape, chunk_size, **{p: parts[p] for p in PARTS}, xxh3=xxh3, payload_xxh3=payload)
    validate(tensor)
    return tensor


def validate(t: CompressedTensor) -> None:
    """Every rule of FORMAT.md that can be checked without decoding, then the payload checksum."""
    def fail(problem: str):
        raise corrupt(t.name, problem)

    if any(d < 0 for d in t.shape):
        fail(f"negative dimension in shape {t.shape}")
    if not GROUP_SIZE <= t.chunk_size <= MAX_CHUNK_SIZE or t.chunk_size & (t.chunk_size - 1):
        fail(f"chunk_size {t.chunk_size} is not a power of two from {GROUP_SIZE} to {MAX_CHUNK_SIZE}")
    for name, dtype in PARTS.items():
        part = getattr(t, name)
        if part.dtype != dtype:
            fail(f"part {name} has dtype {part.dtype}, the format says {dtype}")
    n, p = t.numel, t.palette.numel()
    if not 1 <= p <= PALETTE_SIZE or t.code_lengths.shape != (p,):
        fail(f"palette has {p} entries and code_lengths {tuple(t.code_lengths.shape)}; need 1..{PALETTE_SIZE}, one length each")
    if torch.unique(t.palette).numel() != p:
        fail(f"palette {t.palette.tolist()} repeats an exponent")
    if not kraft_ok(t.code_lengths.tolist(), MAX_CODE_LENGTH):
        fail(f"code lengths {t.code_lengths.tolist()} are not a prefix code of at most {MAX_CODE_LENGTH} bits")
    if t.sign_mantissa.shape != (n,):
        fail(f"sign_mantissa holds {t.sign_mantissa.numel()} bytes for {n} elements")
    offsets, stream_len = t.chunk_offsets, t.exponent_stream.numel()
    if offsets.shape != (t.num_chunks + 1,):
        fail(f"chunk_offsets holds {offsets.numel()} entries for {t.num_chunks} chunks (needs chunks + 1)")
    if offsets[0].item() != 0 or offsets[-1].item() != stream_len:
        fail(f"chunk_offsets run from {offsets[0].item()} to {offsets[-1].item()}, the stream has {stream_len} words")
    sizes = offsets[1:] - offsets[:-1]
    if t.num_chunks and (sizes.min().item() < 0 or sizes.max().item() > t.chunk_size // 2):
        fail("chunk_offsets are out of order or a chunk is longer than 8 bits per symbol allows")
    escapes = t.escape_groups
    if escapes.ndim != 1 or t.escape_exponents.shape != (escapes.numel(), GROUP_SIZE):
        fail(f"escape_groups {tuple(escapes.shape)} and escape_exponents {tuple(t.escape_exponents.shape)} disagree")
    if escapes.numel():
        if escapes[0].item() < 0 or escapes[-1].item() >= t.num_groups or (escapes[1:] <= escapes[:-1]).any():
            fail(f"escape_groups must be ascending group indices below {t.num_groups}")
        in_palette = torch.zeros(256, dtype=torch.bool)
        in_palette[t.palette.long()] = True
        outside = ~in_palette[t.escape_exponents.long()]
        tail = n - (t.num_groups - 1) * GROUP_SIZE   # the last group may be short: its padding is not data
        if escapes[-1].item() == t.num_groups - 1:
            outside[-1, tail:] = False
        if not outside.any(dim=1).all():
            fail("an escape group holds only palette exponents: the palette and the escape table disagree")
    if payload_checksum(t.shape, t.chunk_size, t.xxh3, t.parts()) != t.payload_xxh3:
        fail("payload checksum mismatch (a byte of its parts or record changed)")
