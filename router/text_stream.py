"""Token ids to client text: incremental detokenization with stop strings cut exactly.

Text that could still be the start of a stop string is held back until the next tokens show it
is not; a stop string found ends the text right before it, even when it spans several tokens.
"""

from __future__ import annotations

from engine.tokenizer import ChatTokenizer, IncrementalDetokenizer


class TextStream:
    def __init__(self, tokenizer: ChatTokenizer, stop: list[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self.stopped = False
        self.text = ""  # everything emitted so far

    def add(self, token_ids: list[int]) -> str:
        """The text now safe to send; sets `stopped` when a stop string was reached."""
        if self.stopped:
            return ""
        self._pending += self._detokenizer.add(token_ids)
        if not self._stop:
            return self._emit(len(self._pending))
        cut = min((i for i in (self._pending.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            delta = self._pending[:cut]
            self._pending = ""
            self.text += delta
            return delta
        return self._emit(max(0, len(self._pending) - self._hold))

    def flush(self) -> str:
        """The held-back tail, once generation ended without reaching a stop string."""
        if self.stopped:
            return ""
        return self._emit(len(self._pending))

    def _emit(self, upto: int) -> str:
        delta, self._pending = self._pending[:upto], self._pending[upto:]
        self.text += delta
        return delta
