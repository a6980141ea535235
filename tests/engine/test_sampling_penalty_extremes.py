"""Penalties at the ends of their accepted ranges, as a client sees them: a repetition penalty far below 1
(1e-40 passes the (0, 10] check) must give a real distribution, not NaN rows that draw garbage tokens.

The reference is transformers' repetition penalty computed in float64, where 1e-40 and 1e-60 divide
without overflow, followed by OpenAI's presence and frequency penalties and the softmax.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from engine.engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams, probabilities, process_logits, sample

VOCAB = 48
PROMPT_LEN = 5


def _case(seed: int) -> tuple[torch.Tensor, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, VOCAB, generator=generator, dtype=torch.float64) * 4
    history = torch.randint(0, VOCAB, (12,), generator=generator).tolist()
    return logits, history


def _reference(logits: torch.Tensor, history: list[int], p: SamplingParams) -> torch.Tensor:
    """The distribution the parameters define, in float64."""
    biased = logits.clone()
    for token_id, bias in p.logit_bias.items():
        biased[0, token_id] += bias
    penalized = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([history]), biased)
    counts = torch.bincount(torch.tensor(history[PROMPT_LEN:]), minlength=VOCAB).to(torch.float64)
    penalized = penalized - counts * p.frequency_penalty - (counts > 0).to(torch.float64) * p.presence_penalty
    return (penalized / p.temperature).softmax(-1)


@pytest.mark.parametrize("penalty", [1e-40, 1e-44, 1e-60, 1e-30, 0.05])
@pytest.mark.parametrize("extras", [
    {},
    {"presence_penalty": -2.0, "frequency_penalty": -2.0},
    {"presence_penalty": 2.0, "frequency_penalty": 2.0, "logit_bias": {3: 100.0, 4: -100.0}},
    {"frequency_penalty": -2.0, "logit_bias": {7: 100.0}, "temperature": 0.3},
])
def test_a_tiny_repetition_penalty_gives_the_exact_distribution(penalty, extras):
    for seed in range(4):
        logits, history = _case(seed)
        p = SamplingParams(**{"temperature": 1.0, **extras}, repetition_penalty=penalty, seed=seed)
        processed = process_logits(logits.float(), [p], [history], [PROMPT_LEN])
        probs = probabilities(processed, [p])
        expected = _reference(logits, history, p)
        assert torch.isfinite(processed).all() and torch.isfinite(probs).all()
        torch.testing.assert_close(probs.double(), expected, atol=1e-5, rtol=0)
        drawn = sample(logits.float(), [p], [seed], [len(history) - PROMPT_LEN], [history], [PROMPT_LEN])
        assert expected[0, drawn[0].token_id] > 0.01  # a token the distribution gives weight, never garbage


PROMPT = [5, 17, 260, 3, 99, 41, 41, 7]


@pytest.fixture(scope="module")
def engine(llama_checkpoint):
    directory, _model = llama_checkpoint
    return LLMEngine(directory, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, block_size=8))


def test_sampling_with_an_absurd_repetition_penalty_follows_its_point_mass(engine):
    """At 1e-40 the seen token with the largest logit outweighs all others by ~1e38: sampled requests
    (any seed, any temperature) must give the greedy request's tokens."""
    outputs: dict[str, list[int]] = {}
    requests = {"greedy": SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1e-40, ignore_eos=True,
                                          presence_penalty=-2.0)}
    for seed, temperature in ((1, 1.0), (2, 0.7), (3, 1.5)):
        requests[f"seed {seed}"] = SamplingParams(max_tokens=6, temperature=temperature, repetition_penalty=1e-40,
                                                  seed=seed, ignore_eos=True, presence_penalty=-2.0)
    for request_id, p in requests.items():
        engine.add_request(request_id, PROMPT, p)
        outputs[request_id] = []
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out.token.token_id)
    assert all(set(tokens) <= set(PROMPT) for tokens in outputs.values())  # only seen tokens are boosted
    assert outputs["seed 1"] == outputs["seed 2"] == outputs["seed 3"] == outputs["greedy"]
