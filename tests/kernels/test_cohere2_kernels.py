"""Command R7B and Command A (cohere2) on the kernel ops: the LayerNorm kernels (the row's mean subtracted, with and
without the residual add; Command R+'s q/k norms with a weight row per head) against the torch ops, and the engine on
the kernels (parallel block, interleaved rotary on the sliding layers only) against the engine on the torch ops."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")
transformers = pytest.importorskip("transformers")

from engine import ops  # noqa: E402
from engine.kernels import ops as kernel_ops  # noqa: E402
from kernel_cases import DEVICE, assert_close  # noqa: E402
from test_model import greedy, save_checkpoint  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_subtracts_each_rows_mean(dtype):
    # 80 columns: a block of 128 with masked columns, which must stay out of the mean and the variance; rows far from
    # zero mean, so an RMSNorm would be far off
    x, residual = (3 + torch.randn(5, 80)).to(dtype).to(DEVICE), torch.randn(5, 80).to(dtype).to(DEVICE)
    weight = (1 + 0.3 * torch.randn(80)).to(DEVICE)   # float32, as the loader stores Cohere's
    got = kernel_ops.layer_norm(x, weight, 1e-5)
    assert got.dtype == dtype
    assert_close(got, ops.layer_norm(x, weight, 1e-5), dtype)
    normed, summed = kernel_ops.add_layer_norm(x, residual, weight, 1e-5)
    expected_normed, expected_sum = ops.add_layer_norm(x, residual, weight, 1e-5)
    assert_close(normed, expected_normed, dtype)
    assert_close(summed, expected_sum, dtype)
    assert (expected_normed.float() - ops.rms_norm(x + residual, weight, 1e-5).float()).abs().max() > 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_of_heads_weighs_each_head_by_its_row(dtype):
    qkv = torch.randn(5, (4 + 2 * 2) * 16).to(dtype).to(DEVICE)
    q = qkv[:, :64].reshape(5, 4, 16)   # a strided view, as the model norms it
    weight = (1 + 0.3 * torch.randn(4, 16)).to(DEVICE)
    assert_close(kernel_ops.layer_norm(q, weight, 1e-5), ops.layer_norm(q, weight, 1e-5), dtype)


def _cohere2():
    return transformers.Cohere2ForCausalLM(transformers.Cohere2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=320, max_position_embeddings=256, initializer_range=0.2, sliding_window=6, logit_scale=1.0,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint("cohere2", _cohere2, tmp_path_factory)


def test_kernel_engine_matches_torch_engine(checkpoint):
    assert greedy(checkpoint, use_kernels=True) == greedy(checkpoint, use_kernels=False)
