"""The sampler's logit processing against references, on the same logits.

Repetition penalty, logit_bias, top-k and min-p are checked against transformers' logits
processors; presence and frequency penalties (transformers has none) against OpenAI's documented
formula written out token by token. Rows with different parameters share one batch, so the
vectorized per-row application is checked too.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper)

from engine.sampling import SamplingParams, allowed_from_bitmask, probabilities, process_logits

VOCAB = 97


def _batch(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _history(length: int, seed: int) -> list[int]:
    # few distinct ids, so tokens repeat and counts above 1 occur
    return torch.randint(0, 12, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_repetition_penalty_and_logit_bias_match_transformers_processors():
    logits = _batch(4)
    histories = [_history(9, seed=i) for i in range(4)]
    params = [SamplingParams(repetition_penalty=1.7), SamplingParams(),
              SamplingParams(logit_bias={3: 5.0, 50: -100.0, 96: 0.25}),
              SamplingParams(repetition_penalty=0.6, logit_bias={1: -2.5, 7: 1.5})]
    ours = process_logits(logits, params, histories, [4] * 4)
    for row, p in enumerate(params):
        expected = logits[row:row + 1].clone()
        ids = torch.tensor([histories[row]])
        if p.logit_bias:
            bias = SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()])
            expected = bias(ids, expected)
        if p.repetition_penalty != 1.0:
            expected = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, expected)
        torch.testing.assert_close(ours[row], expected[0])
    assert not torch.equal(ours[0], logits[0]) and torch.equal(ours[1], logits[1])


def test_presence_and_frequency_penalties_follow_openai_formula_over_the_output_only():
    logits = _batch(3, seed=1)
    histories = [_history(14, seed=10 + i) for i in range(3)]
    prompt_lens = [5, 14, 0]  # the second row has generated nothing yet
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.4), SamplingParams(presence_penalty=2.0),
              SamplingParams(presence_penalty=-0.5, frequency_penalty=-1.25, repetition_penalty=1.3)]
    ours = process_logits(logits, params, histories, prompt_lens)
    for row, p in enumerate(params):
        expected = logits[row].clone()
        if p.repetition_penalty != 1.0:
            ids = torch.tensor([histories[row]])
            expected = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, expected[None])[0]
        output = histories[row][prompt_lens[row]:]
        for token in set(output):
            # OpenAI: mu[j] -= c[j] * alpha_frequency + float(c[j] > 0) * alpha_presence
            expected[token] -= output.count(token) * p.frequency_penalty + p.presence_penalty
        torch.testing.assert_close(ours[row], expected)
    torch.testing.assert_close(ours[1], logits[1])  # nothing generated: nothing to penalize


def test_top_k_and_min_p_keep_what_transformers_warpers_keep():
    logits = _batch(1, seed=2)
    scaled = TemperatureLogitsWarper(0.8)(None, logits.clone())
    for top_k, min_p in ((5, 0.0), (0, 0.05), (20, 0.1), (0, 0.0)):
        ours = probabilities(logits, [SamplingParams(temperature=0.8, top_k=top_k, min_p=min_p)])[0]
        expected = scaled.clone()
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if min_p:
            expected = MinPLogitsWarper(min_p)(None, expected)
        assert torch.equal(ours == 0, torch.isinf(expected[0])), (top_k, min_p)
        torch.testing.assert_close(ours, expected[0].softmax(-1))


def test_grammar_mask_leaves_only_allowed_tokens():
    logits = _batch(2, seed=3)
    bitmask = torch.full((2, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    bitmask[0] = 0
    bitmask[0, 0] = (1 << 3) - (1 << 31)           # tokens 3 and 31 (bit 31 is the int32 sign bit)
    bitmask[0, 2] = 1 << 1                         # token 65
    allowed = allowed_from_bitmask(bitmask.numpy(), VOCAB, logits.device)
    ours = process_logits(logits, [SamplingParams(logit_bias={3: -100.0}), SamplingParams()], allowed=allowed)
    assert (~torch.isinf(ours[0])).nonzero().flatten().tolist() == [3, 31, 65]
    assert ours[0].argmax().item() in (31, 65)      # the bias still applies among the allowed
    torch.testing.assert_close(ours[1], logits[1])  # an unconstrained row is untouched
