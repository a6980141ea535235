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
it again, proposals resume after the join. A prediction is indexed once, when the engine first looks it up,
on the engine's thread, so the index is built in numpy: its n-grams' hashes sorted (48 bytes a token; 12 ms
for 32k tokens), where a dictionary of n-gram tuples took about 770 bytes a token and 250 ms for 32k tokens,
a stall of every request in the batch (measured on one CPU core). A lookup where the output goes on
following the prediction compares a few tokens; elsewhere it is one search of the sorted hashes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine.sequence import Sequence

if TYPE_CHECKING:  # engine.speculative looks predictions up here
    from engine.speculative import SpecState

MAX_PREDICTION_MATCH = 4  # the longest output suffix looked up in a prediction
# The longest predicted output a request may bring (router.openai_request.MAX_PREDICTION_TOKENS refuses longer
# ones first): past the longest answers a request asks for, and its index stays small (1.5 MiB).
MAX_PREDICTION_TOKENS = 32768
# An n-gram's hash: the base-_HASH_BASE number of its (token id + 1)s, modulo 2**63 (below numpy's uint64 top,
# so hash + 1 bounds a search). A lookup compares the tokens of the occurrence it picks: a collision only
# costs a proposal.
_HASH_BASE = 0x9E3779B97F4A7C15
_HASH_MASK = (1 << 63) - 1
_HASH_POWERS = [pow(_HASH_BASE, n, _HASH_MASK + 1) for n in range(MAX_PREDICTION_MATCH)]


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
    """A request's predicted output, indexed once: the hashes of its n-grams (n <= MAX_PREDICTION_MATCH)
    sorted, ties in order of position, beside the positions just after them; and how the proposals taken
    from it fared."""

    __slots__ = ("ids", "keys", "ends", "cursor", "num_accepted", "num_rejected")

    def __init__(self, prediction_ids: list[int]) -> None:
        self.ids = list(prediction_ids)
        tokens = np.asarray(self.ids, dtype=np.uint64) + np.uint64(1)
        hashes, every = tokens, []
        for n in range(1, MAX_PREDICTION_MATCH + 1):
            if n > 1:  # the n-gram starting at i: the (n-1)-gram starting there, and one more token
                hashes = (hashes[:-1] * np.uint64(_HASH_BASE) + tokens[n - 1:]) & np.uint64(_HASH_MASK)
            every.append((hashes, np.arange(n, len(tokens) + 1, dtype=np.int32)))
        keys = np.concatenate([h for h, _ in every])
        order = np.argsort(keys, kind="stable")
        self.keys = keys[order]
        self.ends = np.concatenate([e for _, e in every])[order]
        self.cursor = 0          # how far the output has followed the prediction: occurrences past it come first
        self.num_accepted = 0    # proposed tokens the model kept
        self.num_rejected = 0    # proposed tokens it verified and did not keep

    def propose(self, token_ids: list[int], num_prompt_tokens: int, k: int) -> list[int]:
        """Up to k tokens of the prediction after the longest suffix of the output (token_ids past the
        prompt) found in it; [] when none is (or the match ends the prediction)."""
        num_tokens = len(token_ids)
        longest = min(MAX_PREDICTION_MATCH, num_tokens - num_prompt_tokens)
        if longest < 1:
            return []
        end = self.cursor + 1
        if end <= len(self.ids) and self.ids[max(0, end - longest):end] == token_ids[num_tokens - longest:]:
            # the output goes on following the prediction: the nearest occurrence after the cursor is the next one
            self.cursor = end
            return self.ids[end:end + k]
        # every suffix's range of hashes at once: [first, last) per n, longest first
        bounds, key = [], 0
        for token_id in reversed(token_ids[num_tokens - longest:]):
            key = (key + (token_id + 1) * _HASH_POWERS[len(bounds) // 2]) & _HASH_MASK
            bounds += (key, key + 1)
        bounds = self.keys.searchsorted(np.array(bounds, dtype=np.uint64)).tolist()
        for n in range(longest, 0, -1):
            first, last = bounds[2 * n - 2], bounds[2 * n - 1]
            if first == last:
                continue
            if last - first == 1:  # most n-grams occur once
                end = int(self.ends[first])
            else:
                i = first + int(self.ends[first:last].searchsorted(self.cursor, "right"))
                end = int(self.ends[i] if i < last else self.ends[last - 1])
            if self.ids[end - n:end] != token_ids[num_tokens - n:]:  # a hash collision: not an occurrence after all
                continue
            self.cursor = end
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
