"""Sampling parameters and the sampler.

Randomness is a pure function of (request seed, output index): each draw is one uniform number
hashed from both, turned into a token by an inverse-CDF search over the row's distribution. A
request's tokens therefore depend on nothing else in the batch, survive preemption and recompute,
and come out the same when decode continues on another engine after a KV transfer.

Before drawing, `process_logits` turns the model's logits into the ones sampled from, as whole-batch
tensor operations with per-row parameters: logit_bias, the repetition penalty (transformers'
definition, over prompt and output), presence and frequency penalties (OpenAI's definition, over the
output only), then the grammar's allowed-token mask. Each depends only on the row's own tokens,
which every engine holding the sequence has, so determinism survives KV moves and resumes.
Temperature, top-k, top-p and min-p then apply, also as whole-batch operations with per-row values:
a step samples its batch with a fixed number of tensor ops and no generator per row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.errors import InvalidRequestError
from engine.grammar import GrammarSpec

MAX_TOP_LOGPROBS = 20
MAX_REPETITION_PENALTY = 10.0
MAX_PRESENCE_PENALTY = 2.0     # OpenAI's range for presence and frequency penalties: [-2, 2]
MAX_LOGIT_BIAS = 100.0         # OpenAI's range for a logit_bias value: [-100, 100]


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
    presence_penalty: float = 0.0    # subtracted once from every token already in the output
    frequency_penalty: float = 0.0   # subtracted per occurrence in the output
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_p: float = 0.0               # 0 means off; drops tokens below min_p x the top token's probability
    grammar: GrammarSpec | None = None  # the output must follow it (engine.grammar)
    no_speculation: bool = False     # never verify proposed tokens for this request (engine.speculative)
    # The client's predicted output: proposals (engine.ngram.PredictionLookup), verified like any other,
    # so the output is what it would be without them
    prediction_ids: list[int] = field(default_factory=list)

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first out-of-range field."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p"):
            if not _is_number(getattr(self, name)):   # a string would fail later, inside a step of the whole batch
                raise InvalidRequestError(f"{name} must be a number, got {getattr(self, name)!r}")
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= 100:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not math.isfinite(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                                      f"got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -MAX_PRESENCE_PENALTY <= value <= MAX_PRESENCE_PENALTY:
                raise InvalidRequestError(f"{name} must be in [-{MAX_PRESENCE_PENALTY:g}, {MAX_PRESENCE_PENALTY:g}], "
                                          f"got {value!r}")
        if not math.isfinite(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.logit_bias, dict):
            raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        for token_id, bias in self.logit_bias.items():
            if not _is_int(token_id):
                raise InvalidRequestError(f"logit_bias keys must be integer token ids, got {token_id!r}")
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(f"logit_bias token id {token_id!r} is outside the vocabulary "
                                          f"(size {vocab_size})")
            if not _is_number(bias) or not math.isfinite(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                          f"got {bias!r} for token {token_id}")
        if self.grammar is not None:
            self.grammar.validate()
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] and an integer, got {self.logprobs!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidRequestError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id):
                raise InvalidRequestError(f"stop token ids must be integers, got {token_id!r}")
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(f"stop token id {token_id!r} is outside the vocabulary (size {vocab_size})")
        if not isinstance(self.prediction_ids, (list, tuple)):
            raise InvalidRequestError(f"prediction_ids must be a list of token ids, got {self.prediction_ids!r}")
        bad = next((t for t in self.prediction_ids if not _is_int(t) or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"prediction token id {bad!r} is not a token id of this vocabulary (size "
                                      f"{vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def draw_uniform(seed: int, output_index: int, stream: int = 0) -> float:
    """A uniform number in [0, 1) that depends only on (seed, output index, stream).

    splitmix64 of the triple: well spread, so neighbouring indices give unrelated draws. Streams
    keep apart the draws one output position may need (its token; a speculative token's accept test)."""
    x = (seed * 0x9E3779B97F4A7C15 + (output_index + 1) * 0xD1B54A32D192ED03 + stream) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return ((x ^ (x >> 31)) >> 11) / float(1 << 53)


TOKEN_STREAM = 0    # the draw that picks an output position's token
# Speculative decoding with a draft model (engine.speculative): the draft's own draw of a proposed
# token, the accept test of that proposal, and the draw from the residual when it is rejected.
DRAFT_STREAM = 1
ACCEPT_STREAM = 2
RESIDUAL_STREAM = 3


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: softmax(logits / temperature) restricted to top-k,
    top-p and min-p, renormalized. logits [N, V] float32; every row's temperature must be > 0."""
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    # Shifted so each row's top logit is 0 before dividing: a tiny temperature (down to float32's subnormals,
    # which the wire format carries) then sends the other logits towards -inf instead of overflowing the top
    # one to +inf, whose softmax is NaN. The distribution is the same; at such a temperature, a point mass.
    scaled = (logits - logits.amax(-1, keepdim=True)) / temperature[:, None]
    if any(p.top_k or p.top_p < 1.0 for p in params):
        scaled = scaled.masked_fill(_outside_top_k_top_p(scaled, params), float("-inf"))
    probs = scaled.softmax(-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
        below = probs < min_p[:, None] * probs.amax(-1, keepdim=True)
        probs = scaled.masked_fill(below, float("-inf")).softmax(-1)
    return probs


def _outside_top_k_top_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """True where a token falls outside its row's top-k (ties with the k-th kept) or top-p nucleus
    (the smallest head of the sorted distribution whose mass reaches top_p; its first token always stays)."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=scaled.device)
    drop = sorted_logits < sorted_logits.gather(1, (top_k - 1)[:, None])
    top_p = torch.tensor([p.top_p for p in params], dtype=scaled.dtype, device=scaled.device)[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= (sorted_probs.cumsum(-1) - sorted_probs >= top_p) & (top_p < 1.0)
    drop[:, 0] = False
    return torch.zeros_like(drop).scatter_(1, order, drop)


def draw_tokens(probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """Inverse-CDF draw of one token per row of probs [N, V] with the given uniforms in [0, 1).

    Exact for any distribution, and a token of probability 0 is never drawn: the CDF does not rise
    at it, and the search finds the first position where it exceeds the draw. A uniform just below 1
    rounds to 1 in float32 (about one draw in 2**25), and its target to the CDF's total, which no
    position exceeds: such a draw takes the last position where the CDF rises, not the vocabulary's
    last token (which may be outside top-k, biased to -100, or not allowed by the grammar)."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:].contiguous()
    target = torch.tensor(uniforms, dtype=cdf.dtype, device=cdf.device)[:, None] * total
    drawn = torch.searchsorted(cdf, target, right=True)
    last_rise = torch.searchsorted(cdf, total)  # the first position that reaches the total
    # the clamp keeps a row of NaN (no distribution at all) inside the vocabulary
    return torch.minimum(drawn, last_rise).clamp_(max=probs.shape[-1] - 1).squeeze(1)


def _add_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    rows, ids, values = [], [], []
    for row, p in enumerate(params):
        for token_id, bias in p.logit_bias.items():
            rows.append(row)
            ids.append(token_id)
            values.append(bias)
    if not rows:
        return logits
    bias = torch.zeros_like(logits)
    bias[torch.tensor(rows), torch.tensor(ids)] = torch.tensor(values, dtype=logits.dtype)
    return logits + bias


def _padded(histories: list[list[int]], rows: list[int], starts: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [len(rows), longest] of histories[row][start:], right-padded with 0, and the valid mask."""
    slices = [histories[row][start:] for row, start in zip(rows, starts)]
    width = max(1, max(len(ids) for ids in slices))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, tokens in enumerate(slices):
        ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        valid[i, :len(tokens)] = True
    return ids.to(device), valid.to(device)


def _penalize_repetition(logits: torch.Tensor, params: list[SamplingParams],
                         histories: list[list[int]] | None) -> torch.Tensor:
    """transformers' repetition penalty: every token already in the sequence (prompt and output) has its
    logit divided by the penalty when positive, multiplied when negative."""
    rows = [row for row, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return logits
    if histories is None:
        raise ValueError("a repetition penalty needs the sequences' token histories")
    ids, valid = _padded(histories, rows, [0] * len(rows), logits.device)
    # scatter_add, not scatter: the padding (id 0, invalid) of a shorter history would otherwise overwrite
    # a real 0 of that row with False, leaving token 0 unpenalized beside a longer row
    counts = torch.zeros(len(rows), logits.shape[-1], dtype=torch.int32, device=logits.device)
    seen = counts.scatter_add_(1, ids, valid.to(torch.int32)) > 0
    picked = logits[rows]
    penalty = _finite_penalty(params, rows, picked, seen)
    penalized = torch.where(picked < 0, picked * penalty, picked / penalty)
    logits = logits.clone()
    logits[rows] = torch.where(seen, penalized, picked)
    return logits


def _finite_penalty(params: list[SamplingParams], rows: list[int], picked: torch.Tensor,
                    seen: torch.Tensor) -> torch.Tensor:
    """The rows' repetition penalties [len(rows), 1], raised where needed so that dividing a seen logit by
    them stays finite. Any penalty in (0, 1) is valid, but one far below 1 (1e-40) divides a positive logit
    past the float range: +inf, whose softmax is NaN, and a sampled row drew garbage. Where that would
    happen the exact distribution is a point mass on the largest seen logit (it exceeds the next by a
    factor of ~1e38 times their gap), and the raised penalty keeps exactly that: it maps the largest seen
    logit to half the float range (room for the presence and frequency penalties that follow) and every
    other logit proportionally below it. A penalty under the float's smallest normal (1e-46 is 0 in
    float32) is raised to it first, so 0 is never divided by 0."""
    finfo = torch.finfo(picked.dtype)
    penalty = torch.tensor([params[row].repetition_penalty for row in rows], dtype=picked.dtype,
                           device=picked.device).unsqueeze(1).clamp_(min=finfo.tiny)
    largest_seen = torch.where(seen, picked, 0.0).clamp_(min=0.0).amax(-1, keepdim=True)
    return torch.maximum(penalty, largest_seen / (finfo.max / 2))


def _penalize_presence(logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]] | None,
                       prompt_lens: list[int] | None) -> torch.Tensor:
    """OpenAI's presence and frequency penalties over the tokens generated so far:
    logit[t] -= count[t] * frequency_penalty + (count[t] > 0) * presence_penalty."""
    rows = [row for row, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    if not rows:
        return logits
    if histories is None or prompt_lens is None:
        raise ValueError("presence and frequency penalties need the sequences' token histories and prompt lengths")
    ids, valid = _padded(histories, rows, [prompt_lens[row] for row in rows], logits.device)
    counts = torch.zeros(len(rows), logits.shape[-1], dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, ids, valid.to(logits.dtype))
    frequency = torch.tensor([params[row].frequency_penalty for row in rows], dtype=logits.dtype,
                             device=logits.device).unsqueeze(1)
    presence = torch.tensor([params[row].presence_penalty for row in rows], dtype=logits.dtype,
                            device=logits.device).unsqueeze(1)
    logits = logits.clone()
    logits[rows] -= counts * frequency + (counts > 0).to(logits.dtype) * presence
    return logits


def allowed_from_bitmask(bitmask: np.ndarray, vocab_size: int, device) -> torch.Tensor:
    """Bool [rows, vocab_size] from an int32 bitmask [rows, ceil(vocab/32)] (bit t: token t allowed).

    The words' bytes unpacked little-bit-first are the tokens in order (on little-endian hosts, which is
    every host torch runs on here): one numpy pass, where shifting each bit out in torch cost ~70 ms per
    step at batch 32 and a 32k vocabulary."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool).to(device)  # bytes of 0 and 1 are bools: no conversion pass


def process_logits(logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]] | None = None,
                   prompt_lens: list[int] | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The logits [N, V] sampling draws from: logit_bias, then the repetition, presence and frequency
    penalties, then `allowed` (bool [N, V], the grammar's mask: disallowed tokens get -inf).
    `histories` (each row's prompt + output ids) and `prompt_lens` are needed only by penalized rows."""
    logits = _add_logit_bias(logits, params)
    logits = _penalize_repetition(logits, params, histories)
    logits = _penalize_presence(logits, params, histories, prompt_lens)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           output_indices: list[int], histories: list[list[int]] | None = None,
           prompt_lens: list[int] | None = None, allowed: torch.Tensor | None = None) -> list[SampledToken]:
    """One token per row of logits [N, V] (float32), drawn from `process_logits`' result. Logprobs are
    those of the model, before any penalty, bias or mask.

    Greedy rows take the argmax; the others are drawn together (one filter, one softmax, one
    inverse-CDF search for all of them), each with its own uniform from (seed, output index)."""
    want_logprobs = any(p.logprobs is not None for p in params)
    logprobs_all = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    logits = process_logits(logits, params, histories, prompt_lens, allowed)
    token_ids = logits.argmax(dim=-1)
    sampled_rows = [row for row, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        index = torch.tensor(sampled_rows, device=logits.device)
        rows_params = [params[row] for row in sampled_rows]
        uniforms = [draw_uniform(seeds[row], output_indices[row], TOKEN_STREAM) for row in sampled_rows]
        token_ids[index] = draw_tokens(probabilities(logits.index_select(0, index), rows_params), uniforms)
    return sampled_tokens(token_ids, params, logprobs_all)


def sampled_tokens(token_ids: torch.Tensor, params: list[SamplingParams],
                   logprobs_all: torch.Tensor | None) -> list[SampledToken]:
    """SampledToken per row, with the logprobs the rows asked for (one device-to-host copy per kind)."""
    ids = token_ids.tolist()
    if logprobs_all is None:
        return [SampledToken(token_id) for token_id in ids]
    chosen = logprobs_all.gather(1, token_ids[:, None]).squeeze(1).tolist()
    most = max(p.logprobs or 0 for p in params)
    top_ids = top_values = None
    if most:
        values, indices = torch.topk(logprobs_all, most)
        top_ids, top_values = indices.tolist(), values.tolist()
    results = []
    for row, (token_id, p) in enumerate(zip(ids, params)):
        sampled = SampledToken(token_id)
        if p.logprobs is not None:
            sampled.logprob = chosen[row]
            if p.logprobs:
                sampled.top_logprobs = list(zip(top_ids[row][:p.logprobs], top_values[row][:p.logprobs]))
        results.append(sampled)
    return results
