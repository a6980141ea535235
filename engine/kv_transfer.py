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

# A chunk on a byte stream: this header, then its data.
CHUNK_HEADER = struct.Struct("<IIIQI")  # layer, first_token, num_tokens, checksum, data length


@dataclass(slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str            # torch dtype name, e.g. "float32", "bfloat16"
    block_size: int
    num_tokens: int       # tokens whose K/V the payload carries (the prompt)
    model_fingerprint: str
    # 2: keys then values; 1: one latent per token and KV head that is both (multi-head latent attention)
    kv_parts: int = 2

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.kv_parts * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def kv_format(self) -> str:
        """What `check_fits` compares, as one string: engines with equal formats can take each other's KV."""
        latent = "/latent" if self.kv_parts == 1 else ""
        return f"{self.dtype}/{self.num_layers}x{self.num_kv_heads}x{self.head_dim}{latent}/{self.model_fingerprint}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def check_fits(self, expected: KVLayout) -> None:
        """Raise unless K/V of this layout can go into an engine whose layout is `expected`."""
        for name in ("num_layers", "num_kv_heads", "head_dim", "kv_parts", "dtype", "model_fingerprint"):
            if getattr(self, name) != getattr(expected, name):
                raise KVTransferError(f"KV layout mismatch: {name} is {getattr(self, name)!r}, "
                                      f"this engine needs {getattr(expected, name)!r}")

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
    data: bytes | bytearray | memoryview  # each of kv_parts (keys, values) [num_tokens, num_kv_heads, head_dim]
    checksum: int         # xxh3-64 of data

    @classmethod
    def build(cls, layer: int, first_token: int, num_tokens: int, data: bytes) -> KVChunk:
        return cls(layer, first_token, num_tokens, data, checksum(data))

    def verify(self) -> None:
        if checksum(self.data) != self.checksum:
            raise KVTransferError(f"KV chunk for layer {self.layer} tokens {self.first_token}+{self.num_tokens}: checksum mismatch")

    def header(self) -> bytes:
        return CHUNK_HEADER.pack(self.layer, self.first_token, self.num_tokens, self.checksum, len(self.data))

    def check(self, layout: KVLayout) -> None:
        """The chunk names a layer of layout, holds exactly its tokens' bytes, and its checksum holds."""
        if not 0 <= self.layer < layout.num_layers:
            raise KVTransferError(f"KV chunk names layer {self.layer}; the model has {layout.num_layers}")
        expected = self.num_tokens * layout.bytes_per_token_per_layer
        if len(self.data) != expected:
            raise KVTransferError(f"KV chunk for layer {self.layer} has {len(self.data)} bytes, expected {expected}")
        self.verify()


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
        self.layout.check_fits(expected)
        for chunk in self.chunks:
            chunk.check(self.layout)
        self.check_coverage()

    def check_coverage(self) -> None:
        """Every layer's chunks cover the payload's tokens exactly once, in order, with no gap."""
        layout = self.layout
        if layout.num_tokens != len(self.token_ids) or layout.num_tokens < 1:
            raise KVTransferError(f"KV payload covers {layout.num_tokens} tokens but names {len(self.token_ids)} prompt tokens")
        covered = [0] * layout.num_layers
        for chunk in sorted(self.chunks, key=lambda c: (c.layer, c.first_token)):
            if chunk.first_token != covered[chunk.layer]:
                raise KVTransferError(f"KV chunks for layer {chunk.layer} leave a gap or overlap at token {covered[chunk.layer]}")
            covered[chunk.layer] += chunk.num_tokens
        missing = [layer for layer, n in enumerate(covered) if n != layout.num_tokens]
        if missing:
            raise KVTransferError(f"KV payload is incomplete: layers {missing[:8]} do not cover all {layout.num_tokens} tokens")
