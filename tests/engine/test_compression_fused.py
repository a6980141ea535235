"""compressed_in_memory on a checkpoint that stores gate and up fused (Phi-3's gate_up_proj): its MLP
weights stay compressed and the memory saved goes to the KV cache, as for separate projections, and the
answers are those of the plain checkpoint."""

from __future__ import annotations

import pytest
import torch

from engine.compression.compress import compress_checkpoint
from engine.compression.streamed import StreamedLayers
from engine.engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 99, 3, 120], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


def _engine(directory, **config) -> LLMEngine:
    return LLMEngine(directory, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, dtype="float32", **config))


def _greedy(llm: LLMEngine) -> dict[str, list[int]]:
    for index, prompt in enumerate(PROMPTS):
        llm.add_request(str(index), prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while llm.has_work():
        for out in llm.step():
            tokens.setdefault(out.request_id, []).append(out.token.token_id)
    return tokens


def test_a_fused_gate_up_checkpoint_stays_compressed_and_answers_as_the_plain_one(tmp_path):
    # MLPs big enough that the savings beat the decode buffer and tables (as in test_compression_checkpoint).
    torch.manual_seed(0)
    config = transformers.Phi3Config(hidden_size=256, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
    transformers.Phi3ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "plain")
    compress_checkpoint(tmp_path / "plain", tmp_path / "compressed", show_progress=False)

    plain = _engine(tmp_path / "plain")
    streamed = _engine(tmp_path / "compressed", weight_mode="compressed_in_memory")
    layers = streamed.model.weights.layers
    assert isinstance(layers, StreamedLayers) and layers.num_compressed == config.num_hidden_layers
    gained = streamed.stats().num_kv_blocks_from_compression
    assert gained > 0 and streamed.stats().num_blocks_total == plain.stats().num_blocks_total + gained
    assert _greedy(streamed) == _greedy(plain)
