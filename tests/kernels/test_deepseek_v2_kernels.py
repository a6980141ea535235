"""DeepSeek-V2 (`deepseek_v2`) on the kernel ops: the latent attention's projections and norms (a compressed query
through q_a_layernorm) and the softmax group-limited routing's experts, with a shared one, on the fused MoE kernel; the
engine on the kernels against transformers, for a prompt and the decode steps after it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")
transformers = pytest.importorskip("transformers")

from engine.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.kernels import ops as kernel_ops  # noqa: E402
from kernel_cases import DEVICE  # noqa: E402

from tests.engine.conftest import save_random_checkpoint  # noqa: E402
from tests.engine.test_deepseek_v2 import VARIANTS  # noqa: E402
from tests.engine.test_reference import engine_greedy  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek-v2")
    factory, edits = VARIANTS["v2"]
    return directory, save_random_checkpoint(directory, factory, edits)


def test_kernel_engine_logits_and_greedy_tokens_match_transformers(checkpoint):
    directory, reference = checkpoint
    engine = LLMEngine(directory, EngineConfig(device=str(DEVICE), dtype="float32", kv_cache_bytes=2 << 20,
                                               block_size=4, show_progress=False))
    engine.model.ops = kernel_ops
    prompt = [7, 300, 12, 45, 45, 160, 3, 99]
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(engine.prompt_logits(prompt).cpu(), theirs, rtol=1e-4, atol=1e-4)
    tokens = engine_greedy(engine, [prompt], max_tokens=2)[0]
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt + tokens[:-1]])).logits[0]
    assert theirs[len(prompt) - 1:].argmax(-1).tolist() == tokens
