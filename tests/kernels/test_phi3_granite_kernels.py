"""Phi-3's partial rotary and Granite's softmax scale on the kernel ops: the rotary kernel with tables
narrower than the heads, and the engine on the kernels against the engine on the torch ops."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")
transformers = pytest.importorskip("transformers")

from engine import ops  # noqa: E402
from engine.config import RopeConfig  # noqa: E402
from engine.kernels import ops as kernel_ops  # noqa: E402
from kernel_cases import DEVICE, assert_close  # noqa: E402
from test_model import greedy, save_checkpoint  # noqa: E402

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=320, max_position_embeddings=256, initializer_range=0.1)
FACTORS = [1.0, 1.5, 2.0, 3.0, 4.0, 5.0]
# tables of 256 positions, within the default original context: the short factors rotate them
LONGROPE = RopeConfig(rope_type="longrope", attention_factor=1.2, short_factor=FACTORS)
ARCHITECTURES = {
    "phi3-partial-longrope": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **SMALL, pad_token_id=0, eos_token_id=2, partial_rotary_factor=0.75, original_max_position_embeddings=64,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": FACTORS})),
    "granite": lambda: transformers.GraniteForCausalLM(transformers.GraniteConfig(
        **SMALL, embedding_multiplier=12.0, attention_multiplier=0.09, residual_multiplier=0.22, logits_scaling=8.0)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim, rope", [(12, LONGROPE), (8, RopeConfig())])
def test_apply_rotary_on_part_of_each_head(rotary_dim, rope, dtype):
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 4, 2, 16
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype).to(DEVICE)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = q.reshape(num_tokens, num_heads, head_dim), k.reshape(num_tokens, num_kv_heads, head_dim)
    cos, sin = ops.rope_cos_sin(rotary_dim, rope, 256, DEVICE)
    positions = torch.tensor([0, 1, 77, 200, 255], device=DEVICE)
    got_q, got_k = kernel_ops.apply_rotary(q, k, positions, cos, sin)
    ref_q, ref_k = ops.apply_rotary(q, k, positions, cos, sin)
    assert_close(got_q, ref_q, dtype)
    assert_close(got_k, ref_k, dtype)
    assert torch.equal(got_k[..., rotary_dim:], k[..., rotary_dim:])   # the dims past the rotary ones pass through
    assert not torch.equal(got_k[1:, :, :rotary_dim], k[1:, :, :rotary_dim])


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    return save_checkpoint(request.param, ARCHITECTURES[request.param], tmp_path_factory)


def test_kernel_engine_matches_torch_engine(checkpoint):
    assert greedy(checkpoint, use_kernels=True) == greedy(checkpoint, use_kernels=False)
