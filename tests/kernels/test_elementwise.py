"""Norm, activation, rotary and KV-write kernels against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")

from engine import ops  # noqa: E402
from engine.config import RopeConfig  # noqa: E402
from engine.kernels import ops as kernel_ops  # noqa: E402
from kernel_cases import DEVICE, assert_close  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def rand(*shape, dtype):
    return torch.randn(*shape).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 64), (5, 96), (2, 3, 16)])
def test_rms_norm(shape, dtype):
    x, weight = rand(*shape, dtype=dtype), 1 + 0.1 * rand(shape[-1], dtype=dtype)
    assert_close(kernel_ops.rms_norm(x, weight, 1e-6), ops.rms_norm(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_head_view(dtype):
    # Qwen3's q_norm runs on q sliced out of the fused qkv projection.
    qkv = rand(4, 3 * 2 * 16, dtype=dtype)
    q = qkv[:, : 2 * 16].reshape(4, 2, 16)
    weight = 1 + 0.1 * rand(16, dtype=dtype)
    assert_close(kernel_ops.rms_norm(q, weight, 1e-6), ops.rms_norm(q, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 64), (7, 80)])
def test_add_rms_norm(shape, dtype):
    x, residual = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)
    weight = 1 + 0.1 * rand(shape[-1], dtype=dtype)
    normed, new_residual = kernel_ops.add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_residual = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert_close(normed, ref_normed, dtype)
    assert_close(new_residual, ref_residual, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 48), (2, 2 * 1500)])
def test_silu_and_mul(shape, dtype):
    gate_up = 3 * rand(*shape, dtype=dtype)
    assert_close(kernel_ops.silu_and_mul(gate_up), ops.silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (6, 1, 32), (2, 2, 24)])
@pytest.mark.parametrize("rope", [RopeConfig(), RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 64)])
def test_apply_rotary(num_heads, num_kv_heads, head_dim, rope, dtype):
    num_tokens = 5
    qkv = rand(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = q.reshape(num_tokens, num_heads, head_dim), k.reshape(num_tokens, num_kv_heads, head_dim)
    cos, sin = ops.rope_cos_sin(head_dim, rope, 256, DEVICE)
    positions = torch.tensor([0, 1, 77, 200, 255], device=DEVICE)
    got_q, got_k = kernel_ops.apply_rotary(q, k, positions, cos, sin)
    ref_q, ref_k = ops.apply_rotary(q, k, positions, cos, sin)
    assert_close(got_q, ref_q, dtype)
    assert_close(got_k, ref_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_write_kv(block_size, dtype):
    num_blocks, num_kv_heads, head_dim, num_tokens = 8, 2, 16, 6
    kv = rand(num_tokens, 2 * num_kv_heads * head_dim, dtype=dtype)
    k, v = (t.reshape(num_tokens, num_kv_heads, head_dim) for t in kv.chunk(2, dim=-1))
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(DEVICE)
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(4)]
    kernel_ops.write_kv(k, v, caches[0], caches[1], slots)
    ops.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_write_kv_skips_padding_slots():
    """A CUDA-graph padding row carries slot -1 and must leave the cache untouched."""
    k = rand(3, 2, 16, dtype=torch.float32)
    v = rand(3, 2, 16, dtype=torch.float32)
    k_cache = torch.zeros(4, 4, 2, 16, device=DEVICE)
    v_cache = torch.zeros(4, 4, 2, 16, device=DEVICE)
    kernel_ops.write_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 9], device=DEVICE))
    flat = k_cache.view(-1, 2, 16)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[9], k[2])
    assert int((flat.abs().sum((1, 2)) > 0).sum()) == 2
