"""Token ids to client text: incremental detokenization with stop strings cut exactly.

Text that could still be the start of a stop string is held back until the next tokens show it
is not; a stop string found ends the text right before it, even when it spans several tokens. Stop
strings end words: given the answer's tool-call format (`calls`) and the functions the request offers (`names`),
they are looked for only before the first call opens (the format's `calls_start`: its marker, or a call written
without it), so a stop string that the calls' arguments happen to hold does not cut a call into arguments that do
not parse. Text that may still grow into a call's opening is held back, and searched, once the next tokens show
whether it does.
"""

from __future__ import annotations

from engine.tokenizer import ChatTokenizer
from router.tool_calls import ToolCallFormat


class WindowDetokenizer:
    """Text deltas of a growing token list, decoding a window of at most ~`window_tokens` recent tokens.

    Decoding the whole list at every step costs O(n) per token. Here each step decodes the window
    and emits what it adds to the window's text already emitted. When the window grows past
    `window_tokens` it restarts at the previous emission's first token (a character boundary): a
    window starting on a token already sent keeps decoders that treat a leading token specially (a
    stripped leading space) byte-identical to a full decode. A window ending inside a multi-byte
    character decodes to U+FFFD at its end and emits nothing until the character completes.
    """

    def __init__(self, tokenizer: ChatTokenizer, skip_special_tokens: bool = True, window_tokens: int = 32) -> None:
        self._decode = tokenizer.tokenizer.decode
        self._skip_special_tokens = skip_special_tokens
        self._window_tokens = window_tokens
        self.token_ids: list[int] = []
        self._start = 0        # first token of the window
        self._read_end = 0     # end of the tokens whose text was emitted
        self._read_text = ""   # the text of token_ids[_start:_read_end], all emitted

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (may be empty while a character is partial)."""
        ids = self.token_ids
        ids.extend(token_ids)
        text = self._decode(ids[self._start:], self._skip_special_tokens)
        if len(text) <= len(self._read_text) or text.endswith("\ufffd"):
            return ""
        delta = text[len(self._read_text):]
        if len(ids) - self._start > self._window_tokens:
            self._start = self._read_end
            self._read_text = self._decode(ids[self._start:], self._skip_special_tokens)
        else:
            self._read_text = text
        self._read_end = len(ids)
        return delta

    def flush(self) -> str:
        """The text still held back once no token will follow: a character left incomplete by the last
        tokens decodes to U+FFFD, as a full decode of every token gives it."""
        text = self._decode(self.token_ids[self._start:], self._skip_special_tokens)
        delta = text[len(self._read_text):]
        self._read_text, self._read_end = text, len(self.token_ids)
        return delta


class TextStream:
    def __init__(self, tokenizer: ChatTokenizer, stop: list[str], skip_special_tokens: bool = True,
                 calls: ToolCallFormat | None = None, names: frozenset[str] | None = None) -> None:
        self._detokenizer = WindowDetokenizer(tokenizer, skip_special_tokens)
        self._stop = [s for s in stop if s]
        self._calls = calls if self._stop and calls is not None and calls.marker else None
        self._names = names
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self.stopped = False
        self.text = ""  # everything emitted so far

    def add(self, token_ids: list[int]) -> str:
        """The text now safe to send; sets `stopped` when a stop string was reached."""
        if self.stopped:
            return ""
        self._pending += self._detokenizer.add(token_ids)
        return self._cut_or_emit(max(0, len(self._pending) - self._hold))

    def flush(self) -> str:
        """The held-back tail, once generation ended without reaching a stop string (a stop string may
        still lie in it, or in the incomplete character the last tokens leave)."""
        if self.stopped:
            return ""
        self._pending += self._detokenizer.flush()
        return self._cut_or_emit(len(self._pending), ended=True)

    def _cut_or_emit(self, upto: int, ended: bool = False) -> str:
        """The pending text before a stop string (setting `stopped`), else its first `upto` characters. Before the
        calls, a tail that may grow into a call's opening is neither searched nor sent (unless the answer `ended`):
        no opening then begins in text already sent."""
        if not self._stop:
            return self._emit(len(self._pending))
        calls = self._calls_start()
        if calls is None:
            held = 0 if ended or self._calls is None else self._calls.held_back(self._pending, self._names)
            searched = self._pending[:len(self._pending) - held]
            if held:  # nor the start of a stop string that may run on into that tail
                upto = min(upto, max(0, len(searched) - self._hold))
        else:
            searched = self._pending[:calls]
        cut = min((i for i in (searched.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut < 0 and calls is not None:  # the calls begin: no stop string from here on
            self._stop = []
            return self._emit(len(self._pending))
        if cut >= 0:
            self.stopped = True
            delta = self._pending[:cut]
            self._pending = ""
            self.text += delta
            return delta
        return self._emit(upto)

    def _calls_start(self) -> int | None:
        """Where the first tool call opens in the pending text, None while none has."""
        if self._calls is None:
            return None
        found = self._calls.calls_start(self._pending, self._names)
        return None if found < 0 else found

    def _emit(self, upto: int) -> str:
        delta, self._pending = self._pending[:upto], self._pending[upto:]
        self.text += delta
        return delta
