"""Paged attention kernels (decode with split-K, prefill over a cached prefix) against engine.ops.

The reference is the torch op in float32 on the same (possibly bf16-rounded) inputs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")

from engine import ops  # noqa: E402
from engine.kernels import ops as kernel_ops  # noqa: E402
from engine.kernels.decode_attention import decode_attention  # noqa: E402
from kernel_cases import DEVICE, assert_close, make_batch  # noqa: E402

SCALE = 0.25


def reference(q, k_cache, v_cache, batch, window):
    return ops.paged_attention(q.float(), k_cache.float(), v_cache.float(), batch, SCALE, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 4, 16), (4, 2, 4), (8, 2, 8), (8, 1, 16)])
def test_decode_gqa_ragged(num_heads, num_kv_heads, block_size, dtype):
    q, k_cache, v_cache, batch = make_batch([1, 1, 1, 1], [1, 9, 70, 131], num_heads, num_kv_heads, 32,
                                            block_size, dtype, DEVICE)
    got = kernel_ops.paged_attention(q, k_cache, v_cache, batch, SCALE, None)
    assert_close(got, reference(q, k_cache, v_cache, batch, None), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits,window", [(2, None), (5, None), (3, 40)])
def test_decode_split_k(num_splits, window, dtype):
    q, k_cache, v_cache, batch = make_batch([1, 1, 1], [3, 150, 260], 4, 2, 16, 16, dtype, DEVICE)
    got = decode_attention(q, k_cache, v_cache, batch.block_tables, batch.decode_context_lens, SCALE, window,
                           num_splits=num_splits)
    assert_close(got, reference(q, k_cache, v_cache, batch, window), dtype)


def test_decode_sliding_window():
    q, k_cache, v_cache, batch = make_batch([1, 1], [20, 100], 4, 2, 16, 8, torch.float32, DEVICE)
    got = kernel_ops.paged_attention(q, k_cache, v_cache, batch, SCALE, 24)
    assert_close(got, reference(q, k_cache, v_cache, batch, 24), torch.float32)


def test_decode_padding_row_is_zero():
    """CUDA-graph padding rows have context length 0: they must give zeros, not NaN."""
    q, k_cache, v_cache, batch = make_batch([1, 1], [5, 5], 4, 2, 16, 4, torch.float32, DEVICE)
    lens = torch.tensor([5, 0], device=DEVICE)
    for splits in (1, 3):
        got = decode_attention(q, k_cache, v_cache, batch.block_tables, lens, SCALE, None, num_splits=splits)
        assert torch.equal(got[1], torch.zeros_like(got[1]))
        assert_close(got[:1], reference(q, k_cache, v_cache, batch, None)[:1], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 2, 16), (2, 2, 4), (8, 1, 8)])
def test_prefill_fresh_and_cached_prefix(num_heads, num_kv_heads, block_size, dtype):
    # A fresh prompt (queries == context), a prefix-cache hit (5 new of 45), a chunk in the middle.
    q, k_cache, v_cache, batch = make_batch([37, 5, 16], [37, 45, 80], num_heads, num_kv_heads, 16,
                                            block_size, dtype, DEVICE)
    got = kernel_ops.paged_attention(q, k_cache, v_cache, batch, SCALE, None)
    assert_close(got, reference(q, k_cache, v_cache, batch, None), dtype)


@pytest.mark.parametrize("window", [7, 40])
def test_prefill_sliding_window(window):
    q, k_cache, v_cache, batch = make_batch([70, 20], [70, 90], 4, 2, 16, 16, torch.float32, DEVICE)
    got = kernel_ops.paged_attention(q, k_cache, v_cache, batch, SCALE, window)
    assert_close(got, reference(q, k_cache, v_cache, batch, window), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_decode_and_prefill_batch(dtype):
    q, k_cache, v_cache, batch = make_batch([1, 1, 1, 12, 40], [30, 1, 66, 12, 52], 6, 2, 32, 8, dtype, DEVICE)
    got = kernel_ops.paged_attention(q, k_cache, v_cache, batch, SCALE, None)
    assert_close(got, reference(q, k_cache, v_cache, batch, None), dtype)
