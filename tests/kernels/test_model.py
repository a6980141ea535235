"""The engine on the kernel ops gives the tokens it gives on the torch ops.

On CPU the kernels run under the interpreter, so the model is tiny; the architectures cover
GQA, Qwen3's per-head q/k norm, Mistral's sliding window and ERNIE 4.5's interleaved rotary and mixture of
experts, and the schedule covers batched decode, chunked prefill and prefix-cache hits.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")
transformers = pytest.importorskip("transformers")

from engine.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.kernels import ops as kernel_ops  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from kernel_cases import DEVICE  # noqa: E402

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=320, max_position_embeddings=256)
ARCHITECTURES = {
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, head_dim=16)),
    "mistral-sliding": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=12)),
    # interleaved rotary (q/k rows reordered at load), a dense layer then a sparse one: softmax routing steered by a
    # correction bias, a shared expert
    "ernie4.5-moe": lambda: transformers.Ernie4_5_MoeForCausalLM(transformers.Ernie4_5_MoeConfig(
        **SMALL, moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1)),
}


def save_checkpoint(name: str, make_model, tmp_path_factory):
    """A random-weight checkpoint of `make_model()`, its norms away from 1 so that they matter."""
    torch.manual_seed(7)
    model = make_model()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
    directory = tmp_path_factory.mktemp(name)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    return save_checkpoint(request.param, ARCHITECTURES[request.param], tmp_path_factory)


def greedy(directory, use_kernels: bool) -> dict[str, list[int]]:
    config = EngineConfig(device=str(DEVICE), dtype="float32", kv_cache_bytes=2 << 20, block_size=4,
                          max_num_batched_tokens=24, show_progress=False)
    engine = LLMEngine(directory, config)
    if use_kernels:
        engine.model.ops = kernel_ops
    shared = list(range(10, 30))
    prompts = {"a": shared + [3, 4, 5], "b": [7, 8, 9, 11], "c": list(range(40, 66))}
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outputs = {rid: [] for rid in [*prompts, "d"]}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out.token.token_id)
    engine.add_request("d", shared + [6], params)  # hits the prefix cache a left behind
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out.token.token_id)
    return outputs


def test_kernel_engine_matches_torch_engine(checkpoint):
    assert greedy(checkpoint, use_kernels=True) == greedy(checkpoint, use_kernels=False)
