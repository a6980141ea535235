"""The Triton BF16 decoder gives the torch decoder's bits, and a model decoding its MLP weights with it
every forward (compressed_in_memory) gives the original's tokens. Under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")

from engine.compression import triton_decoder  # noqa: E402
from engine.compression.compress import compress_checkpoint  # noqa: E402
from engine.compression.encoder import compress_tensor  # noqa: E402
from engine.compression.tables import pair_table  # noqa: E402
from engine.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from kernel_cases import DEVICE  # noqa: E402
from tests.compression_cases import cases  # noqa: E402

CASES = {name: t for name, t in cases().items() if name not in ("escapes-everywhere", "tiny", "one-element")}


def triton_decode(compressed) -> torch.Tensor:
    compressed = compressed.to(DEVICE)
    table = pair_table(compressed.palette, compressed.code_lengths).to(DEVICE)
    out = torch.full((compressed.numel + compressed.numel % 2,), 0x5555, dtype=torch.int16, device=DEVICE)
    triton_decoder.decompress_into(compressed, out, table)
    return out[: compressed.numel].cpu()


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_decodes_bit_exactly(name):
    original = CASES[name]
    compressed = compress_tensor(name, original, 64)
    assert torch.equal(triton_decode(compressed), original.reshape(-1).view(torch.int16))


def test_kernel_path_generates_the_original_tokens(tmp_path, monkeypatch):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(11)
    config = Qwen3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256, head_dim=16, max_position_embeddings=128)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "original")
    compress_checkpoint(tmp_path / "original", tmp_path / "compressed", chunk_size=64, show_progress=False)

    def tokens(directory, weight_mode):
        engine = LLMEngine(directory, EngineConfig(device=str(DEVICE), dtype="float32", kv_cache_bytes=1 << 20,
                                                   show_progress=False, weight_mode=weight_mode))
        engine.add_request("r", [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        out = []
        while engine.has_work():
            out += [o.token.token_id for o in engine.step()]
        return out

    expected = tokens(tmp_path / "original", "decompress_on_load")
    kernel_calls = []

    def kernel_decode(t, out, table):   # what decode.decompress_into does on CUDA, here on CPU tensors
        kernel_calls.append(t.name)
        triton_decoder.decompress_into(t, out, table)

    monkeypatch.setattr("engine.compression.streamed.decompress_into", kernel_decode)
    monkeypatch.setattr("engine.loader.needs_pair_tables", lambda device: True)   # as on CUDA: the kernel reads them
    assert tokens(tmp_path / "compressed", "compressed_in_memory") == expected
    assert len(kernel_calls) == 2 * 3   # each of the two forwards decoded the layer's three projections
