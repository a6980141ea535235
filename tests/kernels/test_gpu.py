"""On a real GPU: kernels at Llama-3.1-8B sizes, and the engine (kernels + CUDA graphs) giving the
torch path's greedy tokens. Skipped without CUDA; these are the checks a lent GPU runs."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")

from engine import ops  # noqa: E402
from engine.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.kernels import ops as kernel_ops  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from kernel_cases import DEVICE, assert_close, make_batch  # noqa: E402
from test_model import checkpoint  # noqa: E402,F401  (the module-scoped checkpoint fixture)

# Llama-3.1-8B attention: 32 query heads, 8 KV heads, head_dim 128.
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_real_size(block_size, dtype):
    lens = [1, 17, 1000, 4096, 333, 2048, 64, 3000]
    q, k_cache, v_cache, batch = make_batch([1] * len(lens), lens, HEADS, KV_HEADS, HEAD_DIM, block_size, dtype, DEVICE)
    scale = HEAD_DIM ** -0.5
    got = kernel_ops.paged_attention(q, k_cache, v_cache, batch, scale, None)
    ref = ops.paged_attention(q.float(), k_cache.float(), v_cache.float(), batch, scale, None)
    assert_close(got, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_real_size_with_cached_prefix(dtype):
    q, k_cache, v_cache, batch = make_batch([1, 1, 1024, 300], [50, 700, 1024, 2348], HEADS, KV_HEADS, HEAD_DIM,
                                            16, dtype, DEVICE)
    scale = HEAD_DIM ** -0.5
    for window in (None, 512):
        got = kernel_ops.paged_attention(q, k_cache, v_cache, batch, scale, window)
        ref = ops.paged_attention(q.float(), k_cache.float(), v_cache.float(), batch, scale, window)
        assert_close(got, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_rotary_activation_real_size(dtype):
    x = torch.randn(300, 4096, device=DEVICE).to(dtype)
    residual = torch.randn(300, 4096, device=DEVICE).to(dtype)
    weight = (1 + 0.1 * torch.randn(4096, device=DEVICE)).to(dtype)
    for got, ref in zip(kernel_ops.add_rms_norm(x, residual, weight, 1e-5), ops.add_rms_norm(x, residual, weight, 1e-5)):
        assert_close(got, ref, dtype)
    gate_up = torch.randn(300, 2 * 14336, device=DEVICE).to(dtype)
    assert_close(kernel_ops.silu_and_mul(gate_up), ops.silu_and_mul(gate_up), dtype)
    from engine.config import RopeConfig
    cos, sin = ops.rope_cos_sin(HEAD_DIM, RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192), 8192, DEVICE)
    qkv = torch.randn(300, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=DEVICE).to(dtype)
    q, k, _ = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k = q.reshape(300, HEADS, HEAD_DIM), k.reshape(300, KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, 8192, (300,), device=DEVICE)
    for got, ref in zip(kernel_ops.apply_rotary(q, k, positions, cos, sin), ops.apply_rotary(q, k, positions, cos, sin)):
        assert_close(got, ref, dtype)


def _greedy(directory, use_kernels: bool, cuda_graphs: bool) -> dict[str, list[int]]:
    config = EngineConfig(device="cuda", dtype="float32", kv_cache_bytes=64 << 20, block_size=16,
                          max_num_batched_tokens=64, enable_cuda_graphs=cuda_graphs, show_progress=False)
    engine = LLMEngine(directory, config)
    if not use_kernels:
        engine.model.ops = ops
    assert (engine.executor.decode_graphs is not None) == cuda_graphs
    prompts = {f"r{i}": list(range(10 + i, 10 + i + n)) for i, n in enumerate([5, 40, 17, 90, 3])}
    outputs = {rid: [] for rid in prompts}
    for i, (rid, prompt) in enumerate(prompts.items()):
        # Different lengths: sequences finish at different steps, so decode batches shrink across buckets.
        engine.add_request(rid, prompt, SamplingParams(max_tokens=8 + 4 * i, temperature=0, ignore_eos=True))
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out.token.token_id)
    return outputs


def test_engine_kernels_and_graphs_match_torch_path(checkpoint):  # noqa: F811
    reference = _greedy(checkpoint, use_kernels=False, cuda_graphs=False)
    assert _greedy(checkpoint, use_kernels=True, cuda_graphs=False) == reference
    assert _greedy(checkpoint, use_kernels=True, cuda_graphs=True) == reference
