"""Reading a pinned prompt's K/V out of the pool, one chunk at a time.

An export holds a KV handle open: while it is open the handle neither expires nor frees its
blocks (a release waits for the close), so the blocks it reads cannot be reused underneath it.
That makes `chunks()` safe to run on any thread while the engine keeps stepping, and lets a
transport send one chunk while the next is gathered.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.kv_transfer import KVChunk, KVLayout


@dataclass(slots=True)
class KVExport:
    handle: str
    layout: KVLayout
    token_ids: list[int]
    kv_cache: torch.Tensor        # the engine's whole pool [layers, 2, blocks, block_size, Hkv, D]
    block_table: torch.Tensor     # the pinned sequence's blocks, on the pool's device
    tokens_per_chunk: int

    @property
    def num_chunks(self) -> int:
        return self.layout.num_layers * -(-self.layout.num_tokens // self.tokens_per_chunk)

    @property
    def num_bytes(self) -> int:
        return self.layout.num_layers * self.layout.num_tokens * self.layout.bytes_per_token_per_layer

    def chunks(self) -> Iterator[KVChunk]:
        bs, num_tokens = self.layout.block_size, self.layout.num_tokens
        for layer in range(self.layout.num_layers):
            for first in range(0, num_tokens, self.tokens_per_chunk):
                count = min(self.tokens_per_chunk, num_tokens - first)
                blocks = self.block_table[first // bs: -(-(first + count) // bs)]
                # index_select, not advanced indexing: on CPU the latter is ~15x slower here
                kv = self.kv_cache[layer].index_select(1, blocks).flatten(1, 2)[:, :count]
                # a read-only view of the gathered copy: no second copy into a bytes object
                data = memoryview(kv.contiguous().view(torch.uint8).cpu().numpy()).cast("B").toreadonly()
                yield KVChunk.build(layer, first, count, data)
