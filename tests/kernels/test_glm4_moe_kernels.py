"""GLM-4.5 (`glm4_moe`) on the kernel ops: q/k/v biases, per-head q/k norms and rotary on half of each head ahead of
the paged attention kernels, and a dense layer then grouped-routing experts with a shared one on the fused MoE
kernel; the engine on the kernels against the engine on the torch ops and against transformers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")
transformers = pytest.importorskip("transformers")

from engine.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.kernels import ops as kernel_ops  # noqa: E402
from kernel_cases import DEVICE  # noqa: E402
from test_model import greedy  # noqa: E402

from tests.engine.conftest import save_random_checkpoint  # noqa: E402

GLM = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           intermediate_size=128, vocab_size=320, max_position_embeddings=256, initializer_range=0.1,
           first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
           topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("glm4-moe")
    make = lambda: transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**GLM))  # noqa: E731
    return directory, save_random_checkpoint(directory, make, {})


def test_kernel_engine_matches_torch_engine(checkpoint):
    directory, _ = checkpoint
    assert greedy(directory, use_kernels=True) == greedy(directory, use_kernels=False)


def test_kernel_engine_prompt_logits_match_transformers(checkpoint):
    directory, reference = checkpoint
    engine = LLMEngine(directory, EngineConfig(device=str(DEVICE), dtype="float32", kv_cache_bytes=2 << 20,
                                               block_size=4, show_progress=False))
    engine.model.ops = kernel_ops
    prompt = list(range(7, 30))
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(engine.prompt_logits(prompt).cpu(), theirs, rtol=1e-4, atol=1e-4)
