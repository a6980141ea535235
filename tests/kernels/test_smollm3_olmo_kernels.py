"""SmolLM3 and OLMo 2/3 on the kernel ops: the whole-projection q/k norm (a strided view of the qkv projection, one
row of all heads) against the torch op, and the engine on the kernels (NoPE layers, output-only norms, per-layer
windows and ropes) against the engine on the torch ops."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")
transformers = pytest.importorskip("transformers")

from engine import ops  # noqa: E402
from engine.kernels import ops as kernel_ops  # noqa: E402
from kernel_cases import DEVICE, assert_close  # noqa: E402
from test_model import greedy, save_checkpoint  # noqa: E402

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=320, max_position_embeddings=256, initializer_range=0.1, rope_theta=200.0, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_over_a_whole_projection_of_the_fused_qkv(dtype):
    qkv = torch.randn(5, (4 + 2 * 2) * 16).to(dtype).to(DEVICE)
    q, k, _ = qkv.split([64, 32, 32], dim=-1)   # strided views, as the model norms them
    for x in (q, k):
        weight = (1 + 0.3 * torch.randn(x.shape[-1])).to(DEVICE)   # float32, as the loader stores OLMo 2's
        got = kernel_ops.rms_norm(x, weight, 1e-5)
        assert got.dtype == dtype
        assert_close(got, ops.rms_norm(x, weight, 1e-5), dtype)


# OLMo 3 is OLMo 2's decoder with a sliding layer (and its rope) beside the full one: both kinds run here
ARCHITECTURES = {
    "smollm3": lambda: transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(
        **SHAPE, no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=6)),
    "olmo3": lambda: transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
        **SHAPE, sliding_window=6, layer_types=["sliding_attention", "full_attention"])),
}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    return save_checkpoint(request.param, ARCHITECTURES[request.param], tmp_path_factory)


def test_kernel_engine_matches_torch_engine(checkpoint):
    assert greedy(checkpoint, use_kernels=True) == greedy(checkpoint, use_kernels=False)
