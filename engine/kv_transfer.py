"""KV-cache payloads for moving a prefilled prompt between engines (disaggregated prefill/decode).

A payload is a layout (what model shape, dtype and how many tokens) plus chunks, each holding
one layer's keys and values for a run of tokens, with a 64-bit xxh3 checksum of its bytes (ten
times faster than CRC32, so checking every byte at both ends costs little next to moving it). Chunks serialize on
their own, so a transport can stream them; import checks layout, completeness, sizes and every
checksum before a single byte reaches the cache.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field

import xxhash

from engine.errors import KVTransferError

_CHUNK_HEADER = struct.Struct("<IIIQI")  # layer, first_token, num_tokens, checksum, data length


@dataclass(slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str            # torch dtype name, e.g. "float32", "bfloat16"
    block_size: int
    num_tokens: int       # tokens whose K/V the payload carries (the prompt)
    model_fingerprint: str

    @property
    def bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> KVLayout:
        try:
            return cls(**json.loads(text))
        except (json.JSONDecodeError, TypeError) as exc:
            raise KVTransferError(f"KV layout is not valid ({exc})") from exc


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(slots=True)
class KVChunk:
    layer: int
    first_token: int
    num_tokens: int
    data: bytes | bytearray | memoryview  # keys then values, each [num_tokens, num_kv_heads, head_dim]
    checksum: int         # xxh3-64 of data

    @classmethod
    def build(cls, layer: int, first_token: int, num_tokens: int, data: bytes) -> KVChunk:
        return cls(layer, first_token, num_tokens, data, checksum(data))

    def verify(self) -> None:
        if checksum(self.data) != self.checksum:
            raise KVTransferError(f"KV chunk for layer {self.layer} tokens {self.first_token}+{self.num_tokens}: checksum mismatch")

    def to_bytes(self) -> bytes:
        return _CHUNK_HEADER.pack(self.layer, self.first_token, self.num_tokens, self.checksum, len(self.data)) + bytes(self.data)

    @classmethod
    def from_bytes(cls, raw: bytes) -> KVChunk:
        if len(raw) < _CHUNK_HEADER.size:
            raise KVTransferError("KV chunk is shorter than its header")
        layer, first, num, digest, length = _CHUNK_HEADER.unpack_from(raw)
        data = raw[_CHUNK_HEADER.size:]
        if len(data) != length:
            raise KVTransferError(f"KV chunk declares {length} bytes but carries {len(data)}")
        return cls(layer, first, num, data, digest)


def checksum(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


@dataclass(slots=True)
class KVPayload:
    layout: KVLayout
    token_ids: list[int]
    chunks: list[KVChunk] = field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        return sum(len(c.data) for c in self.chunks)

    def validate(self, expected: KVLayout) -> None:
        """Check the payload fits an engine with layout `expected` and is complete and intact."""
        got = self.layout
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype", "model_fingerprint"):
            if getattr(got, name) != getattr(expected, name):
                raise KVTransferError(f"KV layout mismatch: {name} is {getattr(got, name)!r}, this engine needs {getattr(expected, name)!r}")
        if got.num_tokens != len(self.token_ids) or got.num_tokens < 1:
            raise KVTransferError(f"KV payload covers {got.num_tokens} tokens but names {len(self.token_ids)} prompt tokens")
        covered = [0] * got.num_layers
        per_token = got.bytes_per_token_per_layer
        for chunk in sorted(self.chunks, key=lambda c: (c.layer, c.first_token)):
            if not 0 <= chunk.layer < got.num_layers:
                raise KVTransferError(f"KV chunk names layer {chunk.layer}; the model has {got.num_layers}")
            if chunk.first_token != covered[chunk.layer]:
                raise KVTransferError(f"KV chunks for layer {chunk.layer} leave a gap or overlap at token {covered[chunk.layer]}")
            if len(chunk.data) != chunk.num_tokens * per_token:
                raise KVTransferError(f"KV chunk for layer {chunk.layer} has {len(chunk.data)} bytes, expected {chunk.num_tokens * per_token}")
            chunk.verify()
            covered[chunk.layer] += chunk.num_tokens
        missing = [layer for layer, n in enumerate(covered) if n != got.num_tokens]
        if missing:
            raise KVTransferError(f"KV payload is incomplete: layers {missing[:8]} do not cover all {got.num_tokens} tokens")
