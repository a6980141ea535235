"""compressed_in_memory: MLP weights stay compressed on the device and are decoded just in time.

`StreamedLayers` stands in for the model's list of layers. Iterating it (the model's forward loop
does, and only that) decodes each layer's gate/up/down projections into a reusable buffer before
handing the layer out. On CUDA two buffer sets alternate and a side stream decodes layer i + 1
while the main stream computes layer i; on CPU one set is decoded right before its layer runs.
A model whose weights are plain keeps a plain list, so its forward pays nothing for this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.compression.decode import decompress_into
from engine.compression.format import CompressedTensor


@dataclass(slots=True)
class CompressedMLP:
    # The rows of the fused gate/up weight, in order, on the model's device: (gate, up) as most families store
    # them, or (gate_up,) where the checkpoint stores them fused (Phi-3's gate_up_proj), or (up,) where the MLP has no
    # gate (Nemotron's, Arcee's, Apertus's, StarCoder2's c_fc, nanochat's fc1).
    gate_up: tuple[CompressedTensor, ...]
    down: CompressedTensor
    tables: tuple[torch.Tensor, ...] | None   # pair tables (decode.needs_pair_tables): gate_up's, then down's

    @property
    def parts(self) -> tuple[CompressedTensor, ...]:
        return (*self.gate_up, self.down)

    @property
    def nbytes(self) -> int:
        """The parts; tables are counted by StreamedLayers, since layers share them."""
        return sum(t.nbytes for t in self.parts)


class StreamedLayers:
    """The layer sequence of a model whose MLP weights are held compressed (see the module doc)."""

    def __init__(self, layers: list, mlps: list[CompressedMLP | None], device: torch.device, dtype: torch.dtype):
        self.layers = layers
        self.mlps = mlps
        self.device = device
        self.dtype = dtype
        first = next(m for m in mlps if m is not None)
        intermediate, hidden = first.down.shape[1], first.down.shape[0]
        gate_up_rows = sum(part.shape[0] for part in first.gate_up)   # 2 * intermediate, or intermediate: no gate
        num_sets = 2 if device.type == "cuda" else 1
        self.buffers = [(torch.empty(gate_up_rows, hidden, dtype=dtype, device=device),
                         torch.empty(hidden, intermediate, dtype=dtype, device=device)) for _ in range(num_sets)]
        # Decoded bf16 bits land here first when the engine computes in another dtype.
        largest = max(t.numel for m in mlps if m is not None for t in m.parts) + 1
        self.scratch = None if dtype == torch.bfloat16 else torch.empty(largest, dtype=torch.int16, device=device)
        for index, (layer, mlp) in enumerate(zip(layers, mlps)):
            if mlp is not None:
                layer.gate_up, layer.down = self.buffers[index % num_sets]
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def num_compressed(self) -> int:
        return sum(m is not None for m in self.mlps)

    @property
    def compressed_bytes(self) -> int:
        tables = {id(table): table for m in self.mlps if m is not None for table in m.tables or ()}
        return sum(m.nbytes for m in self.mlps if m is not None) + sum(
            table.numel() * table.element_size() for table in tables.values())

    @property
    def plain_bytes(self) -> int:
        """What the compressed MLP weights would take as plain tensors in the engine's dtype."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        return sum(sum(t.numel for t in m.parts) * element for m in self.mlps if m is not None)

    @property
    def bytes_saved(self) -> int:
        return self.plain_bytes - self.compressed_bytes - self.buffer_bytes

    @property
    def buffer_bytes(self) -> int:
        tensors = [t for pair in self.buffers for t in pair] + ([self.scratch] if self.scratch is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int):
        return self.layers[index]

    def __iter__(self):
        return self._iter_cuda() if self.side_stream is not None else self._iter_in_order()

    def _iter_in_order(self):
        for index, layer in enumerate(self.layers):
            if self.mlps[index] is not None:
                self._decode(index)
            yield layer

    def _iter_cuda(self):
        main, side = torch.cuda.current_stream(self.device), self.side_stream
        ready: list[torch.cuda.Event | None] = [None] * len(self.layers)

        def launch(index: int) -> None:
            if index < len(self.layers) and self.mlps[index] is not None:
                with torch.cuda.stream(side):
                    self._decode(index)
                    ready[index] = torch.cuda.Event()
                    ready[index].record(side)

        side.wait_stream(main)   # the previous forward's last layers may still read the buffers
        launch(0)
        launch(1)
        for index, layer in enumerate(self.layers):
            if ready[index] is not None:
                main.wait_event(ready[index])
            yield layer
            # Layer `index` is now queued on the main stream; its buffers take layer index + 2 once it ran.
            if index + 2 < len(self.layers):
                done = torch.cuda.Event()
                done.record(main)
                side.wait_event(done)
                launch(index + 2)

    def _decode(self, index: int) -> None:
        mlp = self.mlps[index]
        gate_up, down = self.buffers[index % len(self.buffers)]
        tables = mlp.tables or (None,) * len(mlp.parts)
        row = 0
        for part, table in zip(mlp.gate_up, tables):
            self._decode_one(part, table, gate_up[row:row + part.shape[0]])
            row += part.shape[0]
        self._decode_one(mlp.down, tables[-1], down)

    def _decode_one(self, t: CompressedTensor, table: torch.Tensor | None, target: torch.Tensor) -> None:
        n = t.numel
        if self.scratch is None and n % 2 == 0:
            decompress_into(t, target.view(-1).view(torch.int16), table)
            return
        bits = self.scratch[: n + n % 2] if self.scratch is not None else torch.empty(n + 1, dtype=torch.int16, device=self.device)
        decompress_into(t, bits, table)
        target.copy_(bits[:n].view(torch.bfloat16).view(target.shape))
