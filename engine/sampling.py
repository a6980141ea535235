"""Sampling parameters and the sampler.

Randomness is a pure function of (request seed, output index): each draw seeds its own generator
from both. A request's tokens therefore depend on nothing else in the batch, survive preemption
and recompute, and come out the same when decode continues on another engine after a KV transfer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20
MAX_REPETITION_PENALTY = 10.0


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0      # 0 means greedy
    top_k: int = 0                # 0 means off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None   # None: none; n >= 0: the sampled token's logprob plus the top n
    repetition_penalty: float = 1.0  # 1 means off; >1 discourages tokens already in the prompt or output

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first out-of-range field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= 100:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not math.isfinite(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                                      f"got {self.repetition_penalty!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(f"stop token id {token_id} is outside the vocabulary (size {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def _draw_seed(seed: int, output_index: int) -> int:
    # splitmix64 of the pair: well spread, so neighbouring indices give unrelated draws
    x = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] with everything outside top-k / top-p set to -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token once the tokens before it already reach top_p; always keep the first
        drop = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def _penalize_repetition(logits: torch.Tensor, params: list[SamplingParams],
                         histories: list[list[int]] | None) -> torch.Tensor:
    """transformers' repetition penalty: every token already in the sequence (prompt and output) has its
    logit divided by the penalty when positive, multiplied when negative."""
    rows = [row for row, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return logits
    if histories is None:
        raise ValueError("a repetition penalty needs the sequences' token histories")
    logits = logits.clone()
    for row in rows:
        ids = torch.tensor(histories[row], dtype=torch.long, device=logits.device)
        scores = logits[row].gather(0, ids)
        penalty = params[row].repetition_penalty
        logits[row].scatter_(0, ids, torch.where(scores < 0, scores * penalty, scores / penalty))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           output_indices: list[int], histories: list[list[int]] | None = None) -> list[SampledToken]:
    """One token per row of logits [N, V] (float32). `histories` (each row's prompt + output ids) is
    needed only for rows with a repetition penalty. Logprobs are those of the model, before any penalty."""
    results = []
    want_logprobs = any(p.logprobs is not None for p in params)
    logprobs_all = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    logits = _penalize_repetition(logits, params, histories)
    greedy_ids = logits.argmax(dim=-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            token_id = greedy_ids[row]
        else:
            scaled = _filter(logits[row] / p.temperature, p.top_k, p.top_p)
            probs = scaled.softmax(-1)
            generator = torch.Generator(device=logits.device)
            generator.manual_seed(_draw_seed(seeds[row], output_indices[row]))
            noise = torch.empty_like(probs).exponential_(generator=generator)
            token_id = int((probs / noise).argmax())
        sampled = SampledToken(token_id)
        if p.logprobs is not None:
            row_logprobs = logprobs_all[row]
            sampled.logprob = float(row_logprobs[token_id])
            if p.logprobs:
                values, ids = torch.topk(row_logprobs, p.logprobs)
                sampled.top_logprobs = list(zip(ids.tolist(), values.tolist()))
        results.append(sampled)
    return results
