"""Turns one step's schedule into model inputs: flat token ids, positions, cache slots, attention metadata."""

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
    tables = torch.zeros((len(order), max_blocks), dtype=torch.int64)
    for i, item in enumerate(order):
        seq, start = item.seq, item.seq.num_computed_tokens
        end = start + item.num_new_tokens
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start.append(query_start[-1] + item.num_new_tokens)
        context_lens.append(end)
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int64)
        if end == seq.num_tokens:
            sample_rows.append(query_start[-1] - 1)
            sample_seqs.append(item)
    batch = AttentionBatch(
        num_decode=num_decode,
        query_start=query_start,
        context_lens=context_lens,
        block_tables=tables.to(device),
        decode_context_lens=torch.tensor(context_lens[:num_decode], dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
    )
    return StepInputs(
        order=order,
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        batch=batch,
        sample_rows=sample_rows,
        sample_seqs=sample_seqs,
    )
