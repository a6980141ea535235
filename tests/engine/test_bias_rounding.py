"""Projection biases join the product before its one rounding, as transformers' F.linear adds them: in bfloat16 a
bias added to the already rounded product rounds every biased projection twice. On one-token prompts (whose attention
is the value row itself, so attention kernels cannot differ) the engine's bfloat16 logits equal transformers' bit for
bit on Qwen2 (q/k/v biases) and StarCoder2 (a bias on every projection); ops.linear's paths each fold the bias so in
bfloat16, and in float32 keep the sum of the product and the bias the engine always computed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_matmul, ops
from engine.engine import EngineConfig, LLMEngine
from tests.engine.conftest import SMALL, _qwen2, save_random_checkpoint

transformers = pytest.importorskip("transformers")

TOKENS = [5, 17, 99, 250, 318]


def _starcoder2():
    return transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(
        **SMALL, initializer_range=0.1, bos_token_id=0, eos_token_id=0, use_bias=True, sliding_window=None))


@pytest.fixture
def torch_threads():
    """Sets torch's thread count for one test and puts it back (it is process-wide)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("factory", [_qwen2, _starcoder2], ids=["qwen2", "starcoder2"])
def test_bfloat16_logits_of_a_biased_model_equal_transformers_bit_for_bit(tmp_path, factory, torch_threads):
    torch_threads(1)
    save_random_checkpoint(tmp_path, factory, {})
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    engine = LLMEngine(tmp_path, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, dtype="bfloat16",
                                              block_size=8, device="cpu"))
    for token in TOKENS:
        with torch.no_grad():
            theirs = reference(torch.tensor([[token]])).logits[0].float()
        torch.testing.assert_close(engine.prompt_logits([token]), theirs, rtol=0, atol=0, msg=f"token {token}")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 4, 40])
def test_linear_folds_the_bias_before_rounding_in_bfloat16(rows, threads, torch_threads):
    """Every path of ops.linear (one thread; the per-thread slabs of a large weight at few rows; torch's own above)."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 512, generator=generator).bfloat16()
    weight = (torch.randn(1024, 512, generator=generator) * 0.05).bfloat16()
    bias = torch.randn(1024, generator=generator).bfloat16()
    torch_threads(threads)
    assert torch.equal(ops.linear(x, weight, bias), F.linear(x, weight, bias))
    assert torch.equal(ops.linear(x, weight), F.linear(x, weight))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 4, 16, 40])
def test_float32_linear_adds_the_bias_after_the_product_as_before(rows, threads, torch_threads):
    """Bit for bit the product and then `+ bias`, on the C loop (4 and 16 rows, where built) as on torch's paths."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 512, generator=generator)
    weight = torch.randn(1024, 512, generator=generator) * 0.05
    bias = torch.randn(1024, generator=generator)
    torch_threads(threads)
    assert torch.equal(ops.linear(x, weight, bias), ops.linear(x, weight) + bias)
    if 2 <= rows <= cpu_matmul.MAX_ROWS and cpu_matmul.available():
        assert cpu_matmul.takes(x, weight, bias)
        assert not cpu_matmul.takes(x, weight, bias.double())
