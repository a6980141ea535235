"""The batched sampler against a per-row reference of what temperature, top-k and top-p mean."""

from __future__ import annotations

import torch

from engine.sampling import SamplingParams, probabilities, sample

VOCAB = 16


def reference_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, spelled out: scale, keep the top k (ties kept), keep the smallest nucleus reaching top_p."""
    scaled = logits / p.temperature
    keep = torch.ones(VOCAB, dtype=torch.bool)
    if p.top_k:
        keep &= scaled >= torch.topk(scaled, p.top_k).values[-1]
    probs = scaled.masked_fill(~keep, float("-inf")).softmax(-1)
    if p.top_p < 1:
        mass = 0.0
        for token in torch.argsort(probs, descending=True).tolist():
            if mass >= p.top_p:
                keep[token] = False
            mass += float(probs[token])
    return scaled.masked_fill(~keep, float("-inf")).softmax(-1)


PARAMS = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=4),
          SamplingParams(temperature=1.3, top_p=0.6), SamplingParams(temperature=0.8, top_k=6, top_p=0.8)]


def test_filtered_distribution_matches_the_reference():
    logits = torch.randn(len(PARAMS), VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    got = probabilities(logits, PARAMS)
    for row, p in enumerate(PARAMS):
        torch.testing.assert_close(got[row], reference_distribution(logits[row], p))


def test_draws_follow_the_distribution_and_never_leave_its_support():
    logits = torch.randn(len(PARAMS), VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    num_seeds = 4000
    rows = logits.repeat(num_seeds, 1)
    params = PARAMS * num_seeds
    seeds = [seed for seed in range(num_seeds) for _ in PARAMS]
    tokens = torch.tensor([t.token_id for t in sample(rows, params, seeds, [0] * len(params))])
    counts = torch.zeros(len(PARAMS), VOCAB)
    counts.index_put_((torch.arange(len(tokens)) % len(PARAMS), tokens), torch.ones(len(tokens)), accumulate=True)
    for row, p in enumerate(PARAMS):
        expected = reference_distribution(logits[row], p)
        assert counts[row][expected == 0].sum() == 0, "drew a token outside top-k/top-p"
        total_variation = float((counts[row] / num_seeds - expected).abs().sum() / 2)
        assert total_variation < 0.05, (p, total_variation)


def test_a_draw_depends_only_on_seed_and_output_index():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=1.0)] * 3

    def draw(seeds, indices, rows=logits):
        return [t.token_id for t in sample(rows, params[: len(seeds)], seeds, indices)]

    first = draw([7, 7, 8], [0, 1, 0])
    assert draw([7, 7, 8], [0, 1, 0]) == first
    assert draw([8], [0], logits[2:]) == first[2:]             # alone or in a batch
    assert len({tuple(draw([7], [i], logits[:1])) for i in range(20)}) > 10  # indices give unrelated draws
