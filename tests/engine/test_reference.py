"""The engine computes what transformers computes on the same random-weight checkpoint."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from tests.engine.conftest import ARCHITECTURES, build_checkpoint

PROMPT = [5, 17, 260, 3, 99, 41, 41, 7, 150, 310, 2, 64, 88, 12, 19, 200, 201, 202, 17, 5, 1, 9, 33, 47,
          58, 61, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180, 190]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_logits_match_transformers(tmp_path, arch):
    reference = build_checkpoint(tmp_path, arch)
    engine = LLMEngine(tmp_path, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, block_size=8))
    ours = engine.prompt_logits(PROMPT)
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sharded_checkpoint_loads_identically(tmp_path):
    reference = build_checkpoint(tmp_path, "qwen2", max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    engine = LLMEngine(tmp_path, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False))
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(engine.prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)


def engine_greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outputs = {str(i): [] for i in range(len(prompts))}
    # Half the requests arrive while the first half is already decoding.
    for i in range(0, len(prompts), 2):
        engine.add_request(str(i), prompts[i], params)
    for _ in range(3):
        for out in engine.step():
            outputs[out.request_id].append(out.token.token_id)
    for i in range(1, len(prompts), 2):
        engine.add_request(str(i), prompts[i], params)
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out.token.token_id)
    return [outputs[str(i)] for i in range(len(prompts))]


def _transformers_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_batched_chunked_greedy_matches_transformers(llama_checkpoint):
    directory, model = llama_checkpoint
    generator = torch.Generator().manual_seed(7)
    lengths = [3, 9, 16, 17, 31, 48, 70, 120, 5, 64]
    prompts = [torch.randint(0, 320, (n,), generator=generator).tolist() for n in lengths]
    # A 24-token budget splits every longer prompt into chunks that share steps with decodes.
    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=8 << 20, show_progress=False,
                                               max_num_batched_tokens=24, block_size=8))
    ours = engine_greedy(engine, prompts, max_tokens=12)
    for prompt, tokens in zip(prompts, ours):
        assert tokens == _transformers_greedy(model, prompt, 12)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_repetition_penalty_matches_transformers(llama_checkpoint):
    """Greedy decoding with a repetition penalty picks the tokens transformers' generate picks."""
    directory, model = llama_checkpoint
    cases = {"discourage": (1.8, PROMPT[:12]), "encourage": (0.5, [41, 41, 41, 7, 7, 9])}
    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, block_size=8))
    for name, (penalty, prompt) in cases.items():
        engine.add_request(name, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                        repetition_penalty=penalty))
    outputs: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out.token.token_id)
    for name, (penalty, prompt) in cases.items():
        with torch.no_grad():
            reference = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                       repetition_penalty=penalty, eos_token_id=None, pad_token_id=0)
        assert outputs[name] == reference[0, len(prompt):].tolist()
        assert outputs[name] != _transformers_greedy(model, prompt, 8)  # the penalty changed the answer
