"""CUDA graphs for decode-only steps: one graph per batch-size bucket, replayed instead of launching
every kernel of every layer from Python.

A decode step's shapes depend only on the number of sequences, so each bucket is captured once
at start-up over static input buffers; a step copies its inputs into the buffers' first rows,
pads the rest (slot -1: nothing written; context length 0: zero attention output), replays the
smallest bucket that fits and reads its rows of the static output. All graphs share one memory
pool, captured largest first so the smaller ones reuse its blocks. Steps with prefill chunks, or
more sequences than the largest bucket, run eagerly. CUDA only: the engine builds this only when
its device is a GPU. Under tensor/pipeline parallelism every rank captures its own part (all ranks
capture the same buckets in the same order, so the TP all-reduces inside pair up); a pipeline stage
after the first also copies the incoming hidden states into a static buffer.
"""

from __future__ import annotations

import logging

import torch

from engine.ops import AttentionBatch
from engine.runner import StepInputs

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, max_num_seqs: int, max_blocks_per_seq: int,
                 buckets: tuple[int, ...] = BUCKETS):
        device = kv_cache.device
        sizes = {b for b in buckets if b < max_num_seqs} | {min(max_num_seqs, max(buckets))}
        self.buckets = sorted(sizes)
        self.max_size = self.buckets[-1]
        n = self.max_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int64, device=device)
        self.hidden_in = None
        if not model.shard.is_first_stage:
            self.hidden_in = torch.zeros((n, model.config.hidden_size), dtype=model.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            self._capture(model, kv_cache, size, pool)
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _batch(self, size: int) -> AttentionBatch:
        return AttentionBatch(num_decode=size, query_start=list(range(size + 1)), context_lens=[0] * size,
                              block_tables=self.block_tables[:size], decode_context_lens=self.context_lens[:size],
                              slot_mapping=self.slot_mapping[:size])

    def _capture(self, model, kv_cache: torch.Tensor, size: int, pool) -> None:
        batch = self._batch(size)
        hidden_in = None if self.hidden_in is None else self.hidden_in[:size]
        args = (self.input_ids[:size], self.positions[:size], batch, kv_cache, hidden_in)
        # Run once outside the graph: Triton compiles and caches its kernels on first launch.
        model.forward(*args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[size] = model.forward(*args)
        self.graphs[size] = graph

    def can_run(self, inputs: StepInputs) -> bool:
        num_seqs = len(inputs.batch.context_lens)
        return inputs.batch.num_decode == num_seqs and num_seqs <= self.max_size

    def run(self, inputs: StepInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of a decode-only step; valid until the next run."""
        num_seqs = len(inputs.batch.context_lens)
        size = next(b for b in self.buckets if b >= num_seqs)
        batch = inputs.batch
        self.input_ids[:num_seqs].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:num_seqs].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:num_seqs].copy_(batch.slot_mapping, non_blocking=True)
        self.context_lens[:num_seqs].copy_(batch.decode_context_lens, non_blocking=True)
        self.block_tables[:num_seqs, : batch.block_tables.shape[1]].copy_(batch.block_tables, non_blocking=True)
        if hidden is not None:
            self.hidden_in[:num_seqs].copy_(hidden, non_blocking=True)
        if size > num_seqs:
            self.slot_mapping[num_seqs:size].fill_(-1)
            self.context_lens[num_seqs:size].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:num_seqs]
