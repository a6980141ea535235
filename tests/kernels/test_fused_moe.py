"""The fused mixture-of-experts kernels against engine.ops.fused_moe (the torch reference)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")

from engine import ops  # noqa: E402
from engine.kernels import ops as kernel_ops  # noqa: E402
from engine.kernels.fused_moe import align_by_expert  # noqa: E402
from kernel_cases import DEVICE, assert_close  # noqa: E402


def experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype):
    gate_up = (torch.randn(num_experts, 2 * inter, hidden) / hidden ** 0.5).to(dtype).to(DEVICE)
    down = (torch.randn(num_experts, hidden, inter) / inter ** 0.5).to(dtype).to(DEVICE)
    return gate_up, down


def routed(num_tokens: int, top_k: int, num_experts: int, skew: str) -> tuple[torch.Tensor, torch.Tensor]:
    if skew == "one expert":       # every token's first choice is expert 0, the rest ride along
        ids = torch.stack([torch.randperm(num_experts - 1)[: top_k - 1] + 1 for _ in range(num_tokens)]) \
            if top_k > 1 else torch.zeros((num_tokens, 0), dtype=torch.int64)
        ids = torch.cat([torch.zeros((num_tokens, 1), dtype=torch.int64), ids], dim=1)
    else:
        ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    weights = torch.softmax(torch.randn(num_tokens, top_k), dim=-1)
    return weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,top_k,num_experts,hidden,inter,skew", [
    (1, 2, 8, 64, 32, "spread"),            # a decode step: most experts get nothing
    (5, 3, 6, 48, 40, "spread"),            # widths that are not multiples of the tile sizes
    (37, 2, 4, 64, 96, "spread"),           # enough pairs for the 64-row blocks
    (70, 1, 4, 32, 32, "one expert"),       # every token on one expert, the others idle
    (40, 2, 8, 32, 64, "one expert"),
])
def test_fused_moe_matches_torch(num_tokens, top_k, num_experts, hidden, inter, skew, dtype):
    gate_up, down = experts(num_experts, hidden, inter, dtype)
    x = torch.randn(num_tokens, hidden).to(dtype).to(DEVICE)
    weights, ids = routed(num_tokens, top_k, num_experts, skew)
    expected = ops.fused_moe(x.float(), weights, ids, gate_up.float(), down.float())
    assert_close(kernel_ops.fused_moe(x, weights, ids, gate_up, down), expected, dtype)


@pytest.mark.parametrize("block_m", [4, 16])
def test_align_puts_every_pair_once_in_blocks_of_one_expert(block_m):
    ids = torch.tensor([[3, 1], [1, 0], [3, 1], [1, 3], [1, 0]], device=DEVICE)
    sorted_pairs, block_expert = align_by_expert(ids, 5, block_m)
    num_pairs = ids.numel()
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    flat = ids.flatten()
    for block, expert in enumerate(block_expert.tolist()):
        rows = sorted_pairs[block * block_m:(block + 1) * block_m]
        rows = rows[rows < num_pairs]
        if expert >= 5:
            assert rows.numel() == 0
        else:
            assert (flat[rows.long()] == expert).all()
    # Experts 0, 1, 3 hold 2, 5 and 3 pairs: each run starts on a block boundary.
    assert sum(e < 5 for e in block_expert.tolist()) == sum(-(-n // block_m) for n in (2, 5, 3))


def test_engine_on_the_moe_kernel_gives_the_torch_engines_tokens(tmp_path):
    """A Qwen3-MoE engine whose expert compute is the kernel (the rest stays torch, to keep the
    interpreter's share small) generates what the all-torch engine generates."""
    import types

    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams
    from tests.engine.conftest import build_checkpoint

    build_checkpoint(tmp_path, "qwen3-moe")

    def greedy(use_kernel: bool) -> dict[str, list[int]]:
        engine = LLMEngine(tmp_path, EngineConfig(device=str(DEVICE), dtype="float32", kv_cache_bytes=2 << 20,
                                                  block_size=4, max_num_batched_tokens=16, show_progress=False))
        if use_kernel:
            engine.model.ops = types.SimpleNamespace(**{**vars(ops), "fused_moe": kernel_ops.fused_moe})
        outputs = {rid: [] for rid in "abc"}
        for rid, n in zip("abc", (23, 4, 9)):
            engine.add_request(rid, list(range(10 + n, 10 + 2 * n)), SamplingParams(max_tokens=3, temperature=0,
                                                                                      ignore_eos=True))
        while engine.has_work():
            for out in engine.step():
                outputs[out.request_id].append(out.token.token_id)
        return outputs

    assert greedy(use_kernel=True) == greedy(use_kernel=False)
