"""N-gram prompt lookup: propose what followed the latest earlier occurrence of the sequence's last n tokens.

No model runs: the proposals come from the sequence's own prompt and output, so they pay off where
the answer repeats its input (quoting, summarizing, editing code) or itself (lists, loops). Each
sequence keeps an index from every n-gram (n_min <= n <= n_max) to where it last ended, extended
by the tokens added since the previous lookup, so a lookup costs a few dictionary reads whatever
the sequence's length. The index only ever holds kept tokens: a rejected proposal leaves nothing to
undo.
"""

from __future__ import annotations

from engine.sequence import Sequence
from engine.speculative import SpecState


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
