"""Turns one step's schedule into model inputs: flat token ids, positions, cache slots, attention metadata.

Embedding requests (engine.pooling) sample nothing: their rows whose hidden states the pooling reads are
`pool_rows`, and the step returns those hidden states beside the logits (`ForwardResult`).

Everything is built on the host as one int64 message, and for a GPU sent with a single
non-blocking copy from pinned memory: one transfer per step, and no wait on the GPU. The message
is self-describing (counts first), so it is also what rank 0 hands the other ranks of a
tensor/pipeline-parallel engine, which rebuild the same inputs from it (`unpack_step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.ops import AttentionBatch
from engine.scheduler import ScheduledSeq

# the message: [num_seqs, num_decode, num_tokens, num_sample_rows, max_blocks, num_pool_rows], query_start
# (num_seqs + 1), context_lens (num_seqs), input_ids, positions, slots (num_tokens each), sample_rows, block
# tables, pool_rows
NUM_COUNTS = 6
NUM_TOKENS_AT = 2


@dataclass(slots=True)
class PoolSpan:
    """An embedding request's part of a step: its first position, and its rows among the pooled ones."""

    item: ScheduledSeq
    start: int
    rows: range           # into ForwardResult.pooled


class ForwardResult(NamedTuple):
    logits: torch.Tensor | None   # [sample rows, vocab] float32; None when no row samples
    pooled: torch.Tensor | None   # [pool rows, hidden] final hidden states; None when no row is pooled


@dataclass(slots=True)
class StepInputs:
    order: list[ScheduledSeq]     # decode-shaped (one token) first, then prefill chunks; empty on other ranks
    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch
    sample_rows: list[int]        # flat row of the last token of each sequence that samples this step
    sample_index: torch.Tensor    # the same rows, on the device
    sample_seqs: list[ScheduledSeq]
    message: torch.Tensor         # all of the above, packed on the host (int64)
    pool_rows: list[int] = None   # flat rows whose final hidden states embedding requests pool
    pool_index: torch.Tensor | None = None   # the same rows, on the device
    pool_spans: list[PoolSpan] = None        # rank 0 only: which request each pooled row belongs to


def prepare_step(scheduled: list[ScheduledSeq], block_size: int, device: torch.device,
                 all_rows: bool = False) -> StepInputs:
    """all_rows: logits of every row, not only each sequence's last (prompt scoring)."""
    # a sequence with proposed tokens has several queries: it goes with the prefill chunks
    order = ([s for s in scheduled if s.num_new_tokens == 1 and not s.draft_ids]
             + [s for s in scheduled if s.num_new_tokens > 1 or s.draft_ids])
    num_decode = sum(1 for s in order if s.num_new_tokens == 1 and not s.draft_ids)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    sample_rows: list[int] = []
    sample_seqs: list[ScheduledSeq] = []
    pool_rows: list[int] = []
    pool_spans: list[PoolSpan] = []
    max_blocks = max(len(s.seq.block_table) for s in order)
    tables: list[int] = []
    for item in order:
        seq, start = item.seq, item.seq.num_computed_tokens
        end = start + item.num_new_tokens
        input_ids.extend(seq.token_ids[start:end])
        stop = end + len(item.draft_ids)
        if item.draft_ids:
            input_ids.extend(item.draft_ids)
        positions.extend(range(start, stop))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, stop))
        query_start.append(query_start[-1] + stop - start)
        context_lens.append(stop)
        tables.extend(table)
        tables.extend([0] * (max_blocks - len(table)))
        if seq.pooling is not None:
            first_row = query_start[-2] - start
            wanted = seq.pooling.pooling.positions(start, end, seq.num_tokens)
            pool_spans.append(PoolSpan(item, start, range(len(pool_rows), len(pool_rows) + len(wanted))))
            pool_rows.extend(first_row + p for p in wanted)
        elif end == seq.num_tokens and not all_rows:
            # the last token's row, then one row per proposed token (each row's logits verify the next)
            sample_rows.extend(range(query_start[-1] - 1 - len(item.draft_ids), query_start[-1]))
            sample_seqs.append(item)
    if all_rows:
        sample_rows = list(range(len(input_ids)))
    counts = [len(order), num_decode, len(input_ids), len(sample_rows), max_blocks, len(pool_rows)]
    parts = [counts, query_start, context_lens, input_ids, positions, slots, sample_rows, tables, pool_rows]
    message = torch.tensor([v for part in parts for v in part], dtype=torch.int64)
    inputs = _inputs(message, counts, query_start, context_lens, sample_rows, device, order, sample_seqs)
    inputs.pool_spans = pool_spans
    return inputs


def unpack_step(message: torch.Tensor, device: torch.device) -> StepInputs:
    """Another rank's inputs for the step rank 0 packed into `message` (a host tensor)."""
    counts = message[:NUM_COUNTS].tolist()
    num_seqs, num_tokens, num_sample = counts[0], counts[2], counts[3]
    lists = message[NUM_COUNTS:NUM_COUNTS + 2 * num_seqs + 1].tolist()
    rows_at = NUM_COUNTS + 2 * num_seqs + 1 + 3 * num_tokens
    sample_rows = message[rows_at:rows_at + num_sample].tolist()
    return _inputs(message, counts, lists[:num_seqs + 1], lists[num_seqs + 1:], sample_rows, device, [], [])


def _inputs(message: torch.Tensor, counts: list[int], query_start: list[int], context_lens: list[int],
            sample_rows: list[int], device: torch.device, order: list[ScheduledSeq],
            sample_seqs: list[ScheduledSeq]) -> StepInputs:
    num_seqs, num_decode, num_tokens, num_sample, max_blocks, num_pool = counts
    sizes = [NUM_COUNTS, num_seqs + 1, num_seqs, num_tokens, num_tokens, num_tokens, num_sample, num_seqs * max_blocks,
             num_pool]
    _, _, lens_t, ids_t, pos_t, slots_t, rows_t, tables_t, pool_t = _to_device(message, device).split(sizes)
    batch = AttentionBatch(
        num_decode=num_decode,
        query_start=query_start,
        context_lens=context_lens,
        block_tables=tables_t.view(num_seqs, max_blocks),
        decode_context_lens=lens_t[:num_decode],
        slot_mapping=slots_t,
    )
    pool_rows = message[len(message) - num_pool:].tolist() if num_pool else []
    return StepInputs(order=order, input_ids=ids_t, positions=pos_t, batch=batch, sample_rows=sample_rows,
                      sample_index=rows_t, sample_seqs=sample_seqs, message=message, pool_rows=pool_rows,
                      pool_index=pool_t, pool_spans=[])


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
