"""Turns one step's schedule into model inputs: flat token ids, positions, cache slots, attention metadata.

Everything is built on the host and, for a GPU, packed into one pinned buffer and sent with a
single non-blocking copy: one transfer per step, and no wait on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.ops import AttentionBatch
from engine.scheduler import ScheduledSeq


@dataclass(slots=True)
class StepInputs:
    order: list[ScheduledSeq]     # decode-shaped (one token) first, then prefill chunks
    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch
    sample_rows: list[int]        # flat row of the last token of each sequence that samples this step
    sample_index: torch.Tensor    # the same rows, on the device
    sample_seqs: list[ScheduledSeq]


def prepare_step(scheduled: list[ScheduledSeq], block_size: int, device: torch.device) -> StepInputs:
    order = [s for s in scheduled if s.num_new_tokens == 1] + [s for s in scheduled if s.num_new_tokens > 1]
    num_decode = sum(1 for s in order if s.num_new_tokens == 1)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    sample_rows: list[int] = []
    sample_seqs: list[ScheduledSeq] = []
    max_blocks = max(len(s.seq.block_table) for s in order)
    tables: list[int] = []
    for item in order:
        seq, start = item.seq, item.seq.num_computed_tokens
        end = start + item.num_new_tokens
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start.append(query_start[-1] + item.num_new_tokens)
        context_lens.append(end)
        tables.extend(table)
        tables.extend([0] * (max_blocks - len(table)))
        if end == seq.num_tokens:
            sample_rows.append(query_start[-1] - 1)
            sample_seqs.append(item)
    parts = [input_ids, positions, slots, context_lens[:num_decode], sample_rows, tables]
    packed = _to_device(torch.tensor([v for part in parts for v in part], dtype=torch.int64), device)
    ids_t, pos_t, slots_t, lens_t, rows_t, tables_t = packed.split([len(p) for p in parts])
    batch = AttentionBatch(
        num_decode=num_decode,
        query_start=query_start,
        context_lens=context_lens,
        block_tables=tables_t.view(len(order), max_blocks),
        decode_context_lens=lens_t,
        slot_mapping=slots_t,
    )
    return StepInputs(order=order, input_ids=ids_t, positions=pos_t, batch=batch, sample_rows=sample_rows,
                      sample_index=rows_t, sample_seqs=sample_seqs)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
