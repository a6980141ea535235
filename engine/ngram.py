"""N-gram lookups: propose what followed an earlier occurrence of the sequence's last n tokens, in its own
prompt and output (prompt lookup) or in the output the request predicted (predicted outputs).

No model runs: the proposals come from the sequence's own prompt and output, so they pay off where
the answer repeats its input (quoting, summarizing, editing code) or itself (lists, loops). Each
sequence keeps an index from every n-gram (n_min <= n <= n_max) to where it last ended, extended
by the tokens added since the previous lookup, so a lookup costs a few dictionary reads whatever
the sequence's length. The index only ever holds kept tokens: a rejected proposal leaves nothing to
undo.

A predicted output (OpenAI's `prediction`: an edited file, a rewritten paragraph) is looked up the same
way, over the prediction instead of the sequence: the longest suffix of the output (up to
MAX_PREDICTION_MATCH tokens) that occurs in the prediction, and what follows it there. The answer follows
its prediction in order, so of several occurrences the one nearest after where the output has followed
the prediction to wins (a repeated line is the next one, not the last; in a run that repeats, the
occurrence at the output's own place); where the answer departs from the prediction (the edit) and joins
it again, proposals resume after the join.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING

from engine.sequence import Sequence

if TYPE_CHECKING:  # engine.speculative looks predictions up here
    from engine.speculative import SpecState

MAX_PREDICTION_MATCH = 4  # the longest output suffix looked up in a prediction


class NgramIndex:
    __slots__ = ("ends", "num_indexed")

    def __init__(self) -> None:
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> the index just after its latest occurrence
        self.num_indexed = 0                         # n-grams ending at or before this index are in `ends`


def lookup(tokens: list[int], index: NgramIndex, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens following the latest earlier occurrence of the longest suffix of `tokens` (n_max
    tokens down to n_min) that occurred before; [] when none did."""
    num_tokens = len(tokens)
    ends = index.ends
    # n-grams ending at the last token are the suffix looked up; they are indexed next time
    for end in range(max(index.num_indexed + 1, n_min), num_tokens):
        for n in range(n_min, min(n_max, end) + 1):
            ends[tuple(tokens[end - n:end])] = end
    index.num_indexed = max(index.num_indexed, num_tokens - 1)
    for n in range(min(n_max, num_tokens - 1), n_min - 1, -1):
        end = ends.get(tuple(tokens[num_tokens - n:]))
        if end is None:
            continue
        proposal: list[int] = []
        for position in range(end, end + k):
            # past the end the continuation runs into itself: a repeating span keeps repeating
            proposal.append(tokens[position] if position < num_tokens else proposal[position - num_tokens])
        return proposal
    return []


class PredictionLookup:
    """A request's predicted output, indexed once: every n-gram (n <= MAX_PREDICTION_MATCH) -> the positions
    just after its occurrences, in order; and how the proposals taken from it fared."""

    __slots__ = ("ids", "ends", "cursor", "num_accepted", "num_rejected")

    def __init__(self, prediction_ids: list[int]) -> None:
        self.ids = list(prediction_ids)
        self.ends: dict[tuple[int, ...], list[int]] = {}
        for end in range(1, len(self.ids) + 1):
            for n in range(1, min(MAX_PREDICTION_MATCH, end) + 1):
                self.ends.setdefault(tuple(self.ids[end - n:end]), []).append(end)
        self.cursor = 0          # how far the output has followed the prediction: occurrences past it come first
        self.num_accepted = 0    # proposed tokens the model kept
        self.num_rejected = 0    # proposed tokens it verified and did not keep

    def propose(self, token_ids: list[int], num_prompt_tokens: int, k: int) -> list[int]:
        """Up to k tokens of the prediction after the longest suffix of the output (token_ids past the
        prompt) found in it; [] when none is (or the match ends the prediction)."""
        num_tokens = len(token_ids)
        for n in range(min(MAX_PREDICTION_MATCH, num_tokens - num_prompt_tokens), 0, -1):
            ends = self.ends.get(tuple(token_ids[num_tokens - n:]))
            if ends is None:
                continue
            i = bisect_right(ends, self.cursor)
            self.cursor = end = ends[i] if i < len(ends) else ends[-1]
            return self.ids[end:end + k]
        return []

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """The model kept the first num_accepted of the last proposal: the output followed the prediction that far."""
        self.cursor += num_accepted
        self.num_accepted += num_accepted
        self.num_rejected += num_proposed - num_accepted


class NgramProposer:
    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        proposals = []
        for seq, k in requests:
            state: SpecState = seq.spec
            if state.ngrams is None:
                state.ngrams = NgramIndex()
            proposals.append(lookup(seq.token_ids, state.ngrams, self.n_min, self.n_max, k))
        return proposals

    def draft_probs(self, seq: Sequence) -> None:
        """A proposal here is certain (a point mass): verification compares it with the plain draw."""
        return None

    def settle(self, seq: Sequence, num_accepted: int) -> None:
        pass  # nothing to roll back: the index holds only the sequence's own tokens

    def release(self, seq: Sequence) -> None:
        pass  # the index lives and dies with the sequence
