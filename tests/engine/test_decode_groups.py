"""Decode attention on the CPU: the torch path groups sequences by context length (a batch of short
chats and one long document must not pad every chat to the document's length), the C loop
(engine.cpu_attention) attends them in place; neither may change a single output."""

from __future__ import annotations

import math

import pytest
import torch

from engine import cpu_attention, ops

needs_native = pytest.mark.skipif(not cpu_attention.available(),
                                  reason=f"the C decode attention is not built: {cpu_attention.MISSING}")


@pytest.fixture(params=["torch", "native"])
def attention_path(request, monkeypatch):
    """Runs a test on the torch path (the C loop hidden) and on the C loop."""
    if request.param == "native" and not cpu_attention.available():
        pytest.skip(f"the C decode attention is not built: {cpu_attention.MISSING}")
    if request.param == "torch":
        monkeypatch.setattr(cpu_attention, "_cpu_attention", None)
    return request.param


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


def naive_attention(q, k_cache, v_cache, batch, scale, sliding_window=None):
    """softmax(q K^T) V for each sequence alone, its keys read token by token through its block table."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    for row, length in enumerate(batch.context_lens):
        positions = torch.arange(max(0, length - sliding_window) if sliding_window else 0, length)
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


def test_grouped_decode_attention_equals_each_sequence_alone(attention_path):
    lens = [3, 700, 21, 18, 1, 350, 690, 64]
    q, k_cache, v_cache, batch = make_decode_batch(lens)
    scale = 1 / math.sqrt(q.shape[-1])
    got = ops.paged_attention(q, k_cache, v_cache, batch, scale, None)
    torch.testing.assert_close(got, naive_attention(q, k_cache, v_cache, batch, scale), rtol=1e-5, atol=1e-5)


@needs_native
# Head sizes of the vector loop (multiples of 16: 32, 64 and 128 built in, 48 not) and of the plain one
# (8, 24); runs of KV heads from one per item (32 query heads over one KV head) to a sequence's eight
# split over two items (64 query heads of 16).
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size",
                         [(4, 4, 8, 4), (6, 2, 24, 4), (8, 2, 64, 16), (16, 8, 32, 16), (6, 3, 48, 16),
                          (64, 8, 16, 16), (32, 1, 128, 8)])
@pytest.mark.parametrize("sliding_window", [None, 37])
def test_the_c_loop_equals_each_sequence_alone(num_heads, num_kv_heads, head_dim, block_size, sliding_window):
    lens = [1, 5, 64, 65, 130, 300, 17, 2]
    q, k_cache, v_cache, batch = make_decode_batch(lens, num_heads, num_kv_heads, head_dim, block_size)
    scale = 1 / math.sqrt(head_dim)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the keys are enough for a second thread: both halves are checked
    try:
        got = ops.paged_attention(q, k_cache, v_cache, batch, scale, sliding_window)
    finally:
        torch.set_num_threads(threads)
    assert batch.cpu_plan.native_decode and not batch.cpu_plan.groups
    torch.testing.assert_close(got, naive_attention(q, k_cache, v_cache, batch, scale, sliding_window),
                               rtol=1e-5, atol=1e-5)


@needs_native
def test_the_c_loop_rejects_a_block_id_outside_the_cache():
    q, k_cache, v_cache, batch = make_decode_batch([9, 12])
    batch.block_tables[1, 2] = k_cache.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="block id"):
        ops.paged_attention(q, k_cache, v_cache, batch, 0.3, None)


@needs_native
def test_a_step_of_decodes_verifications_and_a_prefill_chunk_equals_the_torch_path(monkeypatch):
    """Decode rows go to the C loop; speculative verification (a few queries) and a prefill chunk
    stay on the torch path in the same step, and the whole step's output matches the torch path's."""
    generator = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    context_lens, queries = [33, 8, 70, 12, 40], [1, 1, 3, 4, 30]   # 2 decodes, 2 verifications, 1 chunk
    blocks = [-(-n // block_size) for n in context_lens]
    pool = torch.randperm(sum(blocks), generator=generator).tolist()
    tables = torch.zeros((len(blocks), max(blocks)), dtype=torch.int64)
    for row, count in enumerate(blocks):
        tables[row, :count] = torch.tensor([pool.pop() for _ in range(count)])
    shape = (sum(blocks), block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    query_start = [0]
    for n in queries:
        query_start.append(query_start[-1] + n)
    q = torch.randn(query_start[-1], num_heads, head_dim, generator=generator)

    def run():
        batch = ops.AttentionBatch(num_decode=2, query_start=query_start, context_lens=context_lens, block_tables=tables,
                                   decode_context_lens=torch.tensor(context_lens[:2]),
                                   slot_mapping=torch.zeros(0, dtype=torch.int64))
        return ops.paged_attention(q, k_cache, v_cache, batch, 0.25, None), batch.cpu_plan

    native, plan = run()
    assert plan.native_decode and plan.chunks == [4] and sorted(g.num_queries for g in plan.groups) == [3, 4]
    monkeypatch.setattr(cpu_attention, "_cpu_attention", None)
    reference, plan = run()
    assert not plan.native_decode
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)


@needs_native
def test_values_that_are_a_view_of_the_keys_stay_on_the_torch_path():
    """A latent cache (one pool whose first dims are the values) is not the C loop's layout."""
    q, k_cache, v_cache, _batch = make_decode_batch([9, 30], num_heads=4, num_kv_heads=1, head_dim=8)
    assert cpu_attention.supports(q, k_cache, v_cache)
    assert not cpu_attention.supports(q, k_cache, k_cache[..., :6])
