"""Sampling at its numeric edges, as a client sees it: the tokens of a request against transformers'
greedy generate on the same random-weight checkpoint.

- A draw whose uniform rounds to 1 in float32 (about one in 2**25) must still land on a token the
  request allows, not on the vocabulary's last token.
- A tiny temperature (the wire carries float32, subnormals included) is the greedy limit, not a
  softmax of overflowed logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams, draw_tokens, draw_uniform

PROMPT = [5, 17, 260, 3, 99, 41, 41, 7]
# A seed whose first draw is 1 - 1.8e-8: below 1, as every draw is, but 1.0 once in float32 (checked below).
SEED_DRAWING_ALMOST_ONE = 2475848


def _generate(engine: LLMEngine, params: dict[str, SamplingParams]) -> dict[str, list[int]]:
    for request_id, p in params.items():
        engine.add_request(request_id, PROMPT, p)
    outputs: dict[str, list[int]] = {request_id: [] for request_id in params}
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out.token.token_id)
    return outputs


def _greedy_reference(model, max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def engine(llama_checkpoint):
    directory, _model = llama_checkpoint
    return LLMEngine(directory, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, block_size=8))


def test_a_draw_rounding_to_one_stays_on_a_token_of_positive_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0, 0.0]])
    almost_one = 1 - 2.0 ** -40
    assert np.float32(almost_one) == 1.0
    assert draw_tokens(probs, [almost_one, almost_one]).tolist() == [3, 3]
    assert draw_tokens(probs, [0.0, 0.0]).tolist() == [1, 0]


def test_seeded_requests_never_draw_a_token_their_parameters_exclude(engine, llama_checkpoint):
    _directory, model = llama_checkpoint
    assert np.float32(draw_uniform(SEED_DRAWING_ALMOST_ONE, 0)) == 1.0
    last_token = engine.model_config.vocab_size - 1
    outputs = _generate(engine, {
        "top_k=1": SamplingParams(max_tokens=1, temperature=1.0, top_k=1, seed=SEED_DRAWING_ALMOST_ONE),
        "top_p": SamplingParams(max_tokens=1, temperature=0.5, top_p=1e-6, seed=SEED_DRAWING_ALMOST_ONE),
        "biased": SamplingParams(max_tokens=1, temperature=1.0, logit_bias={last_token: -100.0},
                                 seed=SEED_DRAWING_ALMOST_ONE),
    })
    greedy = _greedy_reference(model, 1)
    assert outputs["top_k=1"] == greedy  # top_k=1 keeps the model's top token only
    assert outputs["top_p"] == greedy    # so does a nucleus smaller than any token's probability
    assert outputs["biased"] != [last_token]


@pytest.mark.parametrize("temperature", [1e-40, 1e-44])
def test_a_tiny_temperature_gives_transformers_greedy_tokens(engine, llama_checkpoint, temperature):
    _directory, model = llama_checkpoint
    outputs = _generate(engine, {
        "plain": SamplingParams(max_tokens=6, temperature=temperature, seed=3, ignore_eos=True, logprobs=2),
        "filtered": SamplingParams(max_tokens=6, temperature=temperature, top_k=5, top_p=0.9, min_p=0.1, seed=4,
                                   ignore_eos=True),
    })
    greedy = _greedy_reference(model, 6)
    assert outputs["plain"] == greedy
    assert outputs["filtered"] == greedy
