"""Gemma 3 on the kernel ops: GELU-tanh times up, norms by a float32 1 + weight (rounded after the multiply),
and the engine on the kernels (per-layer windows and per-layer rope tables) against the engine on the torch ops."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")
transformers = pytest.importorskip("transformers")

from engine import ops  # noqa: E402
from engine.kernels import ops as kernel_ops  # noqa: E402
from kernel_cases import DEVICE, assert_close  # noqa: E402
from test_model import greedy, save_checkpoint  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 48), (2, 2 * 1500)])
def test_gelu_tanh_and_mul(shape, dtype):
    gate_up = 4 * torch.randn(*shape).to(dtype).to(DEVICE)
    assert_close(kernel_ops.gelu_tanh_and_mul(gate_up), ops.gelu_tanh_and_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_by_a_float32_weight_round_after_the_multiply(dtype):
    x, residual = torch.randn(7, 80).to(dtype).to(DEVICE), torch.randn(7, 80).to(dtype).to(DEVICE)
    weight = (1 + 0.3 * torch.randn(80)).to(DEVICE)   # float32, as the loader stores Gemma's 1 + weight
    got = kernel_ops.rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype
    assert_close(got, ops.rms_norm(x, weight, 1e-6), dtype)
    normed, new_residual = kernel_ops.add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_residual = ops.add_rms_norm(x, residual, weight, 1e-6)
    assert normed.dtype == dtype
    assert_close(normed, ref_normed, dtype)
    assert_close(new_residual, ref_residual, dtype)


def _gemma3():
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=320, max_position_embeddings=256, initializer_range=0.1,
        sliding_window=6, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 30.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 200.0}}))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint("gemma3", _gemma3, tmp_path_factory)


def test_kernel_engine_matches_torch_engine(checkpoint):
    assert greedy(checkpoint, use_kernels=True) == greedy(checkpoint, use_kernels=False)
