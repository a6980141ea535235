"""Gemma 2 on the kernel ops: attention scores soft-capped by tanh (decode, split decode and prefill, with and
without a window) against the torch op, and the engine on the kernels against the engine on the torch ops."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")
transformers = pytest.importorskip("transformers")

from engine import ops  # noqa: E402
from engine.kernels import ops as kernel_ops  # noqa: E402
from engine.kernels.decode_attention import decode_attention  # noqa: E402
from kernel_cases import DEVICE, assert_close, make_batch  # noqa: E402
from test_model import greedy, save_checkpoint  # noqa: E402

SCALE = 0.25
# scaled scores here spread over about +-4 (q and k of unit entries, 16 dims, SCALE): a cap of 2 bends most of them
SOFTCAP = 2.0


def _reference(q, k_cache, v_cache, batch, window, softcap):
    return ops.paged_attention(q.float(), k_cache.float(), v_cache.float(), batch, SCALE, window, None, softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 24])
def test_decode_and_prefill_soft_cap_their_scores(window, dtype):
    # decode rows first, then a fresh prompt and a chunk over a cached prefix
    q, k_cache, v_cache, batch = make_batch([1, 1, 1, 17, 5], [1, 9, 70, 17, 40], 8, 2, 16, 8, dtype, DEVICE)
    expected = _reference(q, k_cache, v_cache, batch, window, SOFTCAP)
    got = kernel_ops.paged_attention(q, k_cache, v_cache, batch, SCALE, window, None, SOFTCAP)
    assert_close(got, expected, dtype)
    # the cap changes the output: the kernels do not pass by ignoring it
    assert (expected - _reference(q, k_cache, v_cache, batch, window, None)).abs().max() > 5e-2


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_decode_soft_caps_each_split(num_splits):
    q, k_cache, v_cache, batch = make_batch([1, 1, 1], [3, 150, 260], 4, 2, 16, 16, torch.float32, DEVICE)
    got = decode_attention(q, k_cache, v_cache, batch.block_tables, batch.decode_context_lens, SCALE, None,
                           num_splits=num_splits, softcap=SOFTCAP)
    assert_close(got, _reference(q, k_cache, v_cache, batch, None, SOFTCAP), torch.float32)


def _gemma2():
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=320, max_position_embeddings=256, initializer_range=0.2,
        sliding_window=6, query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=4.0))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint("gemma2", _gemma2, tmp_path_factory)


def test_kernel_engine_matches_torch_engine(checkpoint):
    assert greedy(checkpoint, use_kernels=True) == greedy(checkpoint, use_kernels=False)
