"""Decode attention on the CPU path groups sequences by context length: a batch of short chats and
one long document must not pad every chat to the document's length, and grouping must not change
a single output."""

from __future__ import annotations

import math

import torch

from engine import ops


def make_decode_batch(context_lens: list[int], num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 8,
                      block_size: int = 4):
    generator = torch.Generator().manual_seed(0)
    blocks = [-(-n // block_size) for n in context_lens]
    pool = torch.randperm(sum(blocks) + 2, generator=generator).tolist()
    tables = torch.zeros((len(context_lens), max(blocks)), dtype=torch.int64)
    for row, count in enumerate(blocks):
        tables[row, :count] = torch.tensor([pool.pop() for _ in range(count)])
    shape = (sum(blocks) + 2, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    batch = ops.AttentionBatch(num_decode=len(context_lens), query_start=list(range(len(context_lens) + 1)),
                               context_lens=list(context_lens), block_tables=tables,
                               decode_context_lens=torch.tensor(context_lens), slot_mapping=torch.zeros(0, dtype=torch.int64))
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=generator)
    return q, k_cache, v_cache, batch


def naive_attention(q, k_cache, v_cache, batch, scale):
    """softmax(q K^T) V for each sequence alone, its keys read token by token through its block table."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    for row, length in enumerate(batch.context_lens):
        positions = torch.arange(length)
        blocks = batch.block_tables[row, positions // block_size]
        k, v = k_cache[blocks, positions % block_size], v_cache[blocks, positions % block_size]  # [L, Hkv, D]
        for head in range(q.shape[1]):
            weights = torch.softmax(k[:, head // group] @ q[row, head] * scale, dim=0)
            out[row, head] = weights @ v[:, head // group]
    return out


def test_chats_and_a_long_document_are_attended_in_separate_groups():
    lens = [900, 40, 52, 33, 47]
    groups = ops.decode_groups(lens)
    assert groups == [[3, 1, 4, 2], [0]]
    assert sorted(row for group in groups for row in group) == list(range(len(lens)))


def test_groups_never_exceed_the_group_size():
    groups = ops.decode_groups([10] * (2 * ops.DECODE_GROUP + 3))
    assert [len(g) for g in groups] == [ops.DECODE_GROUP, ops.DECODE_GROUP, 3]


def test_grouped_decode_attention_equals_each_sequence_alone():
    lens = [3, 700, 21, 18, 1, 350, 690, 64]
    q, k_cache, v_cache, batch = make_decode_batch(lens)
    scale = 1 / math.sqrt(q.shape[-1])
    got = ops.paged_attention(q, k_cache, v_cache, batch, scale, None)
    torch.testing.assert_close(got, naive_attention(q, k_cache, v_cache, batch, scale), rtol=1e-5, atol=1e-5)
