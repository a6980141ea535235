"""Reading a pinned prompt's K/V out of the pool, one chunk at a time, in the canonical layout.

An export holds a KV handle open: while it is open the handle neither expires nor frees its
blocks (a release waits for the close), so the blocks it reads cannot be reused underneath it.
That makes `chunks()` safe to run on any thread while the engine keeps stepping, and lets a
transport send one chunk while the next is gathered.

A chunk is one layer, all KV heads (engine.kv_transfer). Where those live is a `KVMap`: in a
single-process engine one pool holds them all; under tensor/pipeline parallelism each rank's pool
holds its stage's layers and its KV heads, and rank 0 reads every rank's slice straight from that
rank's pool (engine.parallel.kv_pool maps them into rank 0), so a chunk is assembled once, in the
buffer the transport sends, and nothing else of the payload passes through rank 0's memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from engine.kv_transfer import KVChunk, KVLayout


@dataclass(slots=True)
class KVSlice:
    """A run of one layer's KV heads inside one rank's pool."""

    pool: torch.Tensor    # [its layers, kv_parts, blocks, block_size, its KV heads, D]
    layer: int            # the layer's index in that pool
    heads: range          # the model's KV heads it holds


@dataclass(slots=True)
class KVMap:
    """Per model layer, where its K/V live: `read` names every KV head once, in order; `write` every
    copy (under TP with fewer KV heads than ranks, a head is replicated on several ranks)."""

    read: list[list[KVSlice]]
    write: list[list[KVSlice]]

    @classmethod
    def single(cls, pool: torch.Tensor) -> KVMap:
        slices = [[KVSlice(pool, layer, range(pool.shape[4]))] for layer in range(pool.shape[0])]
        return cls(slices, slices)


@dataclass(slots=True)
class KVExport:
    handle: str
    layout: KVLayout
    token_ids: list[int]
    kv_map: KVMap
    block_table: torch.Tensor     # the pinned sequence's blocks (host)
    tokens_per_chunk: int
    _tables: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    @property
    def num_chunks(self) -> int:
        return self.layout.num_layers * -(-self.layout.num_tokens // self.tokens_per_chunk)

    @property
    def num_bytes(self) -> int:
        return self.layout.num_layers * self.layout.num_tokens * self.layout.bytes_per_token_per_layer

    def chunks(self) -> Iterator[KVChunk]:
        bs, num_tokens = self.layout.block_size, self.layout.num_tokens
        for layer in range(self.layout.num_layers):
            pieces = self.kv_map.read[layer]
            for first in range(0, num_tokens, self.tokens_per_chunk):
                count = min(self.tokens_per_chunk, num_tokens - first)
                parts = [self._gather(piece, first // bs, -(-(first + count) // bs), count) for piece in pieces]
                kv = parts[0].contiguous() if len(parts) == 1 else torch.cat([p.cpu() for p in parts], dim=2)
                # a read-only view of the gathered copy: no second copy into a bytes object
                data = memoryview(kv.view(torch.uint8).cpu().numpy()).cast("B").toreadonly()
                yield KVChunk.build(layer, first, count, data)

    def _gather(self, piece: KVSlice, first_block: int, end_block: int, count: int) -> torch.Tensor:
        """[kv_parts, count, heads, D] of the piece's pool (on its device)."""
        device = piece.pool.device
        table = self._tables.get(device)
        if table is None:
            table = self._tables[device] = self.block_table.to(device)
        # index_select, not advanced indexing: on CPU the latter is ~15x slower here
        return piece.pool[piece.layer].index_select(1, table[first_block:end_block]).flatten(1, 2)[:, :count]
