"""Writing a compressed checkpoint's weights: safetensors shards with the records in their metadata."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.compression.checkpoint import PLAIN_CHECKSUM_PREFIX, PLAIN_DTYPE_PREFIX, RECORD_PREFIX, SHARD_VERSION_KEY
from engine.compression.format import FORMAT_VERSION, CompressedTensor, part_name, tensor_checksum

INDEX_FILE = "model.safetensors.index.json"


class ShardWriter:
    """Collects tensors into shards of about max_bytes each, flushed as they fill; finish() names them
    model.safetensors (one shard) or model-0000i-of-0000n.safetensors with an index, as Hugging Face does."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory = directory
        self.max_bytes = max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.records: dict[str, str] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[Path, list[str]]] = []   # temporary file, entry names

    def add_plain(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.contiguous()
        records = {PLAIN_CHECKSUM_PREFIX + name: tensor_checksum(tensor)}
        if tensor.is_floating_point() and tensor.dtype != torch.bfloat16:   # a vector kept in its source's dtype
            records[PLAIN_DTYPE_PREFIX + name] = str(tensor.dtype)
        self._add({name: tensor}, records)

    def add_compressed(self, t: CompressedTensor) -> None:
        parts = {part_name(t.name, part): value.contiguous() for part, value in t.parts().items()}
        self._add(parts, {RECORD_PREFIX + t.name: json.dumps(t.record(), sort_keys=True)})

    def _add(self, tensors: dict[str, torch.Tensor], records: dict[str, str]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending.update(tensors)
        self.records.update(records)
        self.pending_bytes += size

    def _flush(self) -> None:
        path = self.directory / f"shard-{len(self.shards):05d}.partial"
        metadata = {"format": "pt", SHARD_VERSION_KEY: str(FORMAT_VERSION), **self.records}
        save_file(self.pending, str(path), metadata=metadata)
        self.shards.append((path, list(self.pending)))
        self.pending, self.records, self.pending_bytes = {}, {}, 0

    def finish(self) -> list[Path]:
        if self.pending or not self.shards:
            self._flush()
        count = len(self.shards)
        names = ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map = {}
        for (path, entries), name in zip(self.shards, names):
            path.rename(self.directory / name)
            weight_map.update({entry: name for entry in entries})
        if count > 1:
            (self.directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
        return [self.directory / name for name in names]
