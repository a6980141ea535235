"""gpt-oss on the kernel ops: attention with a learned sink per head (decode, split decode and prefill, with and
without a window), experts with biases and the clamped SwiGLU, and the engine on the kernels against the engine on
the torch ops."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")
transformers = pytest.importorskip("transformers")

from engine import ops  # noqa: E402
from engine.kernels import ops as kernel_ops  # noqa: E402
from engine.kernels.decode_attention import decode_attention  # noqa: E402
from kernel_cases import DEVICE, assert_close, make_batch  # noqa: E402
from test_fused_moe import experts, routed  # noqa: E402
from test_model import greedy, save_checkpoint  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
SCALE = 0.25


def _sinks(num_heads: int) -> torch.Tensor:
    # about the size of a head's scores, so that each sink takes a visible share of its softmax
    return (2 * torch.randn(num_heads)).to(DEVICE)


def _reference(q, k_cache, v_cache, batch, window, sinks):
    return ops.paged_attention(q.float(), k_cache.float(), v_cache.float(), batch, SCALE, window, sinks)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 24])
def test_decode_and_prefill_with_sinks(window, dtype):
    # decode rows first, then a fresh prompt and a chunk over a cached prefix
    q, k_cache, v_cache, batch = make_batch([1, 1, 1, 17, 5], [1, 9, 70, 17, 40], 8, 2, 16, 8, dtype, DEVICE)
    sinks = _sinks(8)
    expected = _reference(q, k_cache, v_cache, batch, window, sinks)
    assert_close(kernel_ops.paged_attention(q, k_cache, v_cache, batch, SCALE, window, sinks), expected, dtype)
    # the sinks change the output: the kernels do not pass by ignoring them
    assert (expected - _reference(q, k_cache, v_cache, batch, window, None)).abs().max() > 1e-2


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_decode_counts_each_sink_once(num_splits):
    q, k_cache, v_cache, batch = make_batch([1, 1, 1], [3, 150, 260], 4, 2, 16, 16, torch.float32, DEVICE)
    sinks = _sinks(4)
    got = decode_attention(q, k_cache, v_cache, batch.block_tables, batch.decode_context_lens, SCALE, None,
                           num_splits=num_splits, sinks=sinks)
    assert_close(got, _reference(q, k_cache, v_cache, batch, None, sinks), torch.float32)


def test_padding_rows_with_sinks_are_zero():
    """CUDA-graph padding rows (context length 0) give zeros with sinks too: only the sink, which weighs no value."""
    q, k_cache, v_cache, batch = make_batch([1, 1], [5, 5], 4, 2, 16, 4, torch.float32, DEVICE)
    lens = torch.tensor([5, 0], device=DEVICE)
    for splits in (1, 3):
        got = decode_attention(q, k_cache, v_cache, batch.block_tables, lens, SCALE, None, num_splits=splits,
                               sinks=_sinks(4))
        assert torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,top_k,num_experts,hidden,inter", [(1, 2, 8, 64, 32), (37, 2, 4, 48, 40)])
def test_fused_moe_with_biases_and_the_clamped_swiglu(num_tokens, top_k, num_experts, hidden, inter, dtype):
    gate_up, down = experts(num_experts, hidden, inter, dtype)
    gate_up_bias = (0.5 * torch.randn(num_experts, 2 * inter)).to(dtype).to(DEVICE)
    down_bias = (0.5 * torch.randn(num_experts, hidden)).to(dtype).to(DEVICE)
    x = (3 * torch.randn(num_tokens, hidden)).to(dtype).to(DEVICE)   # large enough for the clamps to bite
    weights, ids = routed(num_tokens, top_k, num_experts, "spread")
    swiglu = (1.702, 1.0)
    expected = ops.fused_moe(x.float(), weights, ids, gate_up.float(), down.float(), gate_up_bias.float(),
                             down_bias.float(), swiglu)
    got = kernel_ops.fused_moe(x, weights, ids, gate_up, down, gate_up_bias, down_bias, swiglu)
    assert_close(got, expected, dtype)
    unclamped = ops.fused_moe(x.float(), weights, ids, gate_up.float(), down.float(), gate_up_bias.float(),
                              down_bias.float(), (1.702, 1e9))
    assert (expected - unclamped).abs().max() > 1e-2


def _gpt_oss():
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
        max_position_embeddings=128, initializer_range=0.1, swiglu_limit=0.5))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint("gpt-oss", _gpt_oss, tmp_path_factory)


def test_kernel_engine_matches_torch_engine(checkpoint):
    assert greedy(checkpoint, use_kernels=True) == greedy(checkpoint, use_kernels=False)
