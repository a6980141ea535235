"""Speculative decoding: propose a few tokens cheaply, verify them all in one forward of the model.

A decoding sequence normally contributes one query token (its last) to a step. With speculation it
contributes that token plus k proposed ones; the model's logits at each of those 1 + k rows say
what it would have produced at that position. The longest prefix of proposals the model agrees
with is kept, plus the token the model produced after it (a correction, or a bonus when every
proposal was kept), so a step emits between 1 and k + 1 tokens per sequence. The K/V written for
rejected proposals is rolled back: their positions are computed again later, and a block grown only
for them goes back to the pool (the prefix cache only ever hashes blocks of kept tokens).

Proposers: `ngram` (engine.ngram) looks the sequence's last n tokens up in its own prompt and
output and proposes what followed their latest earlier occurrence; `draft` (engine.draft) runs a
smaller model with the same tokenizer, with its own paged KV, k single-token steps per step.
A request may also bring a predicted output (`SamplingParams.prediction_ids`): where the output's
last tokens occur in it, what follows them there is the step's proposal, ahead of the site's proposer
(engine.ngram.PredictionLookup), and on a site configured without speculation too (then with the
default k). Its proposals are verified as n-gram proposals are, so they change no token either; how
they fared is counted per request (reported to the client) and left out of the site's acceptance.
The engine tells the speculator which of its requests brought one (`add`, `release`): on a site without
a proposer of its own, a step of requests without predictions returns at once, looking at none of them.
A proposal kept through a stop token counts as kept up to that token: the output ends there, and what
the model would have kept after it is neither output nor accepted.

What the model "would have produced" at a row is decided exactly as without speculation:

- Greedy rows, and every row verifying an n-gram proposal, draw the row's token with the plain
  sampler (the same logit processing, and the same uniform from (seed, output index)) and keep the
  proposal when it equals that token. So greedy output is token-identical to non-speculative
  decoding, and so is seeded sampling with n-gram proposals: for a proposal q is a point mass, and
  "keep it when the plain draw equals it" is standard speculative sampling (keep with probability
  p(token), otherwise a token from p without it, renormalized) with its two draws coupled to the
  plain one.
- Sampled rows verifying a draft model's proposals use standard speculative sampling: keep the
  proposal d with probability min(1, p(d) / q(d)), otherwise draw from max(0, p - q) normalized
  and stop; when every proposal is kept, the token after them is the plain draw. p and q are the model's and the
  draft's distributions after the request's own logit processing. Each draw has its own uniform
  from (seed, output index, purpose), so the output has exactly the law of plain sampling, and a
  seeded request repeats on any engine whose speculation proposes the same tokens at the same
  positions (the same draft model and k, and a step budget and KV pool that do not cut a step's
  proposals) -- not token for token against an engine without speculation.

When it backs off: a sequence proposes as many tokens as its running acceptance says are likely
enough to be kept (`accept_threshold` on the chance of reaching and keeping each position); when
that acceptance falls below the threshold it stops proposing for 1, 2, 4, ... up to 64 steps and
then probes with one token; an n-gram with no earlier match proposes nothing, so text that does
not repeat costs nothing beyond the lookup. A sequence's acceptance starts from the engine's pooled
record of every sequence's proposals, not from a fixed guess: on a CPU each proposed token costs
the model about one more row of compute, so a proposer that does not agree with the model must not
be re-learned by every new sequence. While the pooled record is below the threshold too, a failed
probe waits the longest backoff at once, and a new sequence starts waiting it, but for one new
sequence every EXPLORE_STEPS steps, which probes for the engine: the batch then pays a probe per 64
steps per sequence, and finds a proposer that starts agreeing again. The pooled record steers only
sequences whose output does not depend on which tokens were proposed (greedy ones, and every n-gram
proposal: a point mass kept exactly when the plain draw equals it); a draft model's sampled
sequences keep a record of their own alone, so a seeded request's proposals, and with them its
tokens, depend on nothing but the request.
Requests with a grammar, prefill-only requests and those with `no_speculation` never speculate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.block_manager import BlockManager
from engine.ngram import PredictionLookup
from engine.sampling import (ACCEPT_STREAM, RESIDUAL_STREAM, SampledToken, SamplingParams, draw_tokens, draw_uniform,
                             probabilities, process_logits, sample, sampled_tokens)
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from engine.runner import StepInputs

# The engine's pooled record starts as if 3 of 4 proposals had been kept; a sequence's record starts
# from the pooled acceptance with the weight of PRIOR_WEIGHT outcomes, and counts recent steps more.
PRIOR_ACCEPTED, PRIOR_REJECTED = 1.5, 0.5
PRIOR_WEIGHT = 2.0
RECORD_DECAY = 0.8
POOLED_DECAY = 0.95  # per verification of any sequence: the pool follows the last few dozen
FIXED_PRIOR = PRIOR_ACCEPTED / (PRIOR_ACCEPTED + PRIOR_REJECTED)
EXPLORE_STEPS = 16  # while the pool fails: steps between new sequences allowed to probe at once
# A sequence whose record falls below the threshold waits 1, 2, 4, ... up to this many of its steps
# before it proposes one token again: a model that never agrees with its proposals costs a probe
# every MAX_BACKOFF_STEPS steps, and one that starts agreeing again is found.
MAX_BACKOFF_STEPS = 64


class SpecState:
    """One sequence's record of how its proposals fared (decayed counts, backoff), and its n-gram index."""

    __slots__ = ("accepted", "rejected", "backoff", "cooldown", "ngrams")

    def __init__(self) -> None:
        self.accepted = 0.0
        self.rejected = 0.0
        self.backoff = 0     # steps the last failure made it wait (doubles while it keeps failing)
        self.cooldown = 0    # steps left to wait before it proposes again
        self.ngrams = None   # engine.ngram.NgramIndex, built on the first lookup

    def acceptance(self, prior: float) -> float:
        """Estimated chance that a proposal is kept, given the ones before it were (prior: the pooled one)."""
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.accepted + self.rejected + PRIOR_WEIGHT)

    def depth(self, limit: int, threshold: float, prior: float) -> int:
        """How many tokens to propose this step: positions whose chance of being reached and kept is
        >= threshold; after a wait, at least one (a probe)."""
        if self.cooldown:
            self.cooldown -= 1
            return 0
        alpha, reach, depth = self.acceptance(prior), 1.0, 0
        while depth < limit:
            reach *= alpha
            if reach < threshold:
                break
            depth += 1
        return max(depth, 1)

    def record(self, num_proposed: int, num_accepted: int, threshold: float, prior: float) -> None:
        self.accepted = self.accepted * RECORD_DECAY + num_accepted
        self.rejected = self.rejected * RECORD_DECAY + (num_accepted < num_proposed)
        if self.acceptance(prior) < threshold:
            # the whole engine's proposals fail too: no use finding out again soon
            longest = prior < threshold
            self.backoff = MAX_BACKOFF_STEPS if longest else min(max(1, 2 * self.backoff), MAX_BACKOFF_STEPS)
            self.cooldown = self.backoff
        else:
            self.backoff = 0


class PooledRecord:
    """Every sequence's verifications together (decayed): the acceptance a new sequence starts from."""

    __slots__ = ("accepted", "rejected")

    def __init__(self) -> None:
        self.accepted, self.rejected = PRIOR_ACCEPTED, PRIOR_REJECTED

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.accepted = self.accepted * POOLED_DECAY + num_accepted
        self.rejected = self.rejected * POOLED_DECAY + (num_accepted < num_proposed)


class Speculator:
    """An engine's speculation: which sequences propose, the proposals, their verification, the counts."""

    def __init__(self, config: SpeculativeConfig, proposer, block_manager: BlockManager,
                 max_num_batched_tokens: int, eos_token_ids: frozenset[int] | set[int] = frozenset()) -> None:
        self.config = config
        # engine.ngram.NgramProposer or engine.draft.DraftProposer; None: only predicted outputs propose
        self.proposer = proposer
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = eos_token_ids  # end a request's output, as its stop_token_ids do (unless ignore_eos)
        self.num_draft_tokens = 0           # proposed tokens verified by the model
        self.num_accepted_tokens = 0        # of those, kept
        self.num_verifications = 0          # sequence-steps that verified at least one proposal
        self.pooled = PooledRecord()
        self._explore_in = 0                # steps until a new sequence may probe while the pool fails
        self._predicted: set[Sequence] = set()  # sequences verifying their prediction's proposals this step
        self._with_prediction: set[Sequence] = set()  # the engine's sequences that brought a predicted output

    def add(self, seq: Sequence) -> None:
        """The engine took the sequence (queued, or imported to decode): note it when it brought a prediction."""
        if seq.params.prediction_ids and not seq.prefill_only:
            self._with_prediction.add(seq)

    # -- before the forward --------------------------------------------------------------------

    def plan(self, scheduled: list[ScheduledSeq]) -> int:
        """Give the scheduled decode sequences that should speculate their proposals (`draft_ids`), with
        blocks for them; returns the number of proposed tokens in the step."""
        self._predicted.clear()
        if self.proposer is None and not self._with_prediction:
            return 0  # a site without speculation, and no request brought a prediction: the common step
        budget = self.max_num_batched_tokens - sum(item.num_new_tokens for item in scheduled)
        wanted: list[tuple[ScheduledSeq, int]] = []
        predicted: list[tuple[ScheduledSeq, list[int]]] = []
        threshold = self.config.accept_threshold
        self._explore_in = max(0, self._explore_in - 1)
        for item in scheduled:
            if budget <= 0:
                break
            seq = item.seq
            if (item.num_new_tokens != 1 or seq.num_computed_tokens + 1 != seq.num_tokens or seq.prefill_only
                    or seq.matcher is not None or seq.params.no_speculation):
                continue
            # never propose past max_tokens or the context: every kept token is a token the request may emit
            limit = min(self.config.num_speculative_tokens, budget, seq.params.max_tokens - seq.num_output_tokens - 1,
                        seq.max_total_tokens - seq.num_tokens - 1)
            if limit < 1:
                continue
            if seq.params.prediction_ids:
                drafts = _prediction(seq).propose(seq.token_ids, seq.num_prompt_tokens, limit)
                if drafts:
                    predicted.append((item, drafts))
                    budget -= len(drafts)
                    continue
            if self.proposer is None:
                continue
            prior = self._prior(seq)
            if seq.spec is None:
                seq.spec = SpecState()
                if prior < threshold:  # the engine's proposals fail: wait, unless it is this one's turn to probe
                    if self._explore_in:
                        seq.spec.backoff = seq.spec.cooldown = MAX_BACKOFF_STEPS
                    else:
                        self._explore_in = EXPLORE_STEPS
            depth = seq.spec.depth(limit, threshold, prior)
            if depth == 0:
                continue
            wanted.append((item, depth))
            budget -= depth
        candidates = [(item, drafts, True) for item, drafts in predicted]
        if wanted:
            proposals = self.proposer.propose([(item.seq, depth) for item, depth in wanted])
            candidates += [(item, drafts, False) for (item, _), drafts in zip(wanted, proposals)]
        num_drafts = 0
        bm = self.block_manager
        for item, drafts, from_prediction in candidates:
            seq, count = item.seq, len(drafts)
            while count and not bm.can_grow(seq, seq.num_tokens + count):  # never preempt for a proposal
                count -= 1
            if not count:
                if not from_prediction:
                    self.proposer.settle(seq, 0)
                continue
            bm.grow(seq, seq.num_tokens + count)
            item.draft_ids = tuple(drafts[:count])
            num_drafts += count
            if from_prediction:
                self._predicted.add(seq)
        return num_drafts

    # -- after the forward ---------------------------------------------------------------------

    def verify(self, inputs: StepInputs, logits: torch.Tensor, allowed: torch.Tensor | None) -> list[list[SampledToken]]:
        """Per sampled sequence of the step, the tokens it emits: its kept proposals and the model's next
        token. logits [rows, vocab]: 1 + len(draft_ids) rows per sequence (engine.runner.prepare_step)."""
        items = inputs.sample_seqs
        penalized = any(_penalized(item.seq.params) for item in items)
        params, seeds, indices, histories, prompt_lens = [], [], [], [], []
        for item in items:
            seq = item.seq
            for i in range(len(item.draft_ids) + 1):
                params.append(seq.params)
                seeds.append(seq.seed)
                indices.append(seq.num_output_tokens + i)
                if penalized:  # the row's history: the sequence and the proposals before the row
                    histories.append(seq.token_ids + list(item.draft_ids[:i]))
                    prompt_lens.append(seq.num_prompt_tokens)
        plain = sample(logits, params, seeds, indices, histories or None, prompt_lens or None, allowed)
        # a draft model's sampled proposals: q from the draft, p for all their rows at once
        draft_q = [None if not item.draft_ids or item.seq.params.greedy or item.seq in self._predicted
                   else self.proposer.draft_probs(item.seq) for item in items]
        p_rows = self._target_probs(items, draft_q, logits, params, histories, prompt_lens)
        emitted, row, p_row = [], 0, 0
        for item, q in zip(items, draft_q):
            seq, drafts = item.seq, item.draft_ids
            rows = slice(row, row + len(drafts) + 1)
            row = rows.stop
            if not drafts:
                emitted.append(plain[rows])
                continue
            if q is None:
                accepted = 0
                while accepted < len(drafts) and plain[rows.start + accepted].token_id == drafts[accepted]:
                    accepted += 1
                tokens = plain[rows.start:rows.start + accepted + 1]
            else:
                p = p_rows[p_row:p_row + len(drafts) + 1]
                p_row += len(drafts) + 1
                tokens = self._speculative_sample(seq, drafts, logits[rows], p, q, plain[rows.stop - 1])
                accepted = len(tokens) - 1
            self._settle(seq, len(drafts), self._num_kept(seq.params, drafts, accepted))
            emitted.append(tokens)
        return emitted

    @staticmethod
    def _target_probs(items: list[ScheduledSeq], draft_q: list, logits: torch.Tensor, params: list, histories: list,
                      prompt_lens: list) -> torch.Tensor | None:
        """p of every row of the sequences whose proposals were sampled from a draft's q, in order."""
        rows, row = [], 0
        for item, q in zip(items, draft_q):
            count = len(item.draft_ids) + 1
            if q is not None:
                rows.extend(range(row, row + count))
            row += count
        if not rows:
            return None
        picked = [params[r] for r in rows]
        processed = process_logits(logits[rows], picked, [histories[r] for r in rows] if histories else None,
                                   [prompt_lens[r] for r in rows] if prompt_lens else None)
        return probabilities(processed, picked)

    def _speculative_sample(self, seq: Sequence, drafts: tuple[int, ...], logits: torch.Tensor, p: torch.Tensor,
                            q: torch.Tensor, bonus: SampledToken) -> list[SampledToken]:
        """Standard speculative sampling of a draft model's proposals: keep d with probability
        min(1, p(d) / q(d)); at the first rejection draw from max(0, p - q) renormalized; when all are
        kept, the plain draw after them (`bonus`). p: the model's distributions at the rows, q: the draft's."""
        chosen: list[int] = []
        for i, draft in enumerate(drafts):
            index = seq.num_output_tokens + i
            p_draft, q_draft = float(p[i, draft]), float(q[i, draft])
            if draw_uniform(seq.seed, index, ACCEPT_STREAM) * q_draft < p_draft:
                chosen.append(draft)
                continue
            residual = (p[i] - q[i]).clamp_(min=0)
            if not float(residual.sum()) > 0:  # rounding only: a rejection needs p < q somewhere, so p > q elsewhere
                residual = p[i]
            uniform = draw_uniform(seq.seed, index, RESIDUAL_STREAM)
            chosen.append(int(draw_tokens(residual[None], [uniform])[0]))
            break
        else:
            chosen.append(bonus.token_id)
        if seq.params.logprobs is None:
            return [SampledToken(token_id) for token_id in chosen]
        rows = len(chosen)
        return sampled_tokens(torch.tensor(chosen), [seq.params] * rows, torch.log_softmax(logits[:rows], dim=-1))

    def _num_kept(self, params: SamplingParams, drafts: tuple[int, ...], num_accepted: int) -> int:
        """Of the first num_accepted proposals, those the output holds: up to the first that ends it."""
        for i in range(num_accepted):
            token_id = drafts[i]
            if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
                return i + 1
        return num_accepted

    def _settle(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        if seq in self._predicted:  # the request's own proposals: they say nothing of the site's proposer
            self._predicted.discard(seq)
            seq.prediction.record(num_proposed, num_accepted)
            return
        self.pooled.record(num_proposed, num_accepted)
        seq.spec.record(num_proposed, num_accepted, self.config.accept_threshold, self._prior(seq))
        self.proposer.settle(seq, num_accepted)
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.num_verifications += 1

    def _prior(self, seq: Sequence) -> float:
        """The acceptance a sequence's record starts from: the pool's where its output does not depend on
        the proposals, else a fixed one (its proposals must depend on the request alone)."""
        if seq.params.greedy or self.config.method == "ngram":
            return self.pooled.acceptance
        return FIXED_PRIOR

    def release(self, seq: Sequence) -> None:
        """The sequence left the engine (finished, aborted): whatever the proposer holds for it goes."""
        self._predicted.discard(seq)
        self._with_prediction.discard(seq)
        if self.proposer is not None:
            self.proposer.release(seq)


def _prediction(seq: Sequence) -> PredictionLookup:
    """The sequence's predicted output, indexed on its first lookup (on this engine: a resume indexes it again)."""
    if seq.prediction is None:
        seq.prediction = PredictionLookup(seq.params.prediction_ids)
    return seq.prediction


def _penalized(params) -> bool:
    return bool(params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty)
