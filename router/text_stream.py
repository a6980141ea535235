"""Token ids to client text: incremental detokenization with stop strings cut exactly.

Text that could still be the start of a stop string is held back until the next tokens show it
is not; a stop string found ends the text right before it, even when it spans several tokens. Stop
strings end words: given the marker that opens an answer's tool calls (`calls_marker`), they are looked
for only before it, so a stop string that the calls' arguments happen to hold does not cut a call into
JSON that does not parse.
"""

from __future__ import annotations

from engine.tokenizer import ChatTokenizer


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
                 calls_marker: str = "") -> None:
        self._detokenizer = WindowDetokenizer(tokenizer, skip_special_tokens)
        self._stop = [s for s in stop if s]
        self._calls_marker = calls_marker if self._stop else ""
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
        return self._cut_or_emit(len(self._pending))

    def _cut_or_emit(self, upto: int) -> str:
        """The pending text before a stop string (setting `stopped`), else its first `upto` characters."""
        if not self._stop:
            return self._emit(len(self._pending))
        calls = self._calls_start()
        searched = self._pending if calls is None else self._pending[:calls]
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
        """Where the tool calls' marker begins in the pending text (0 when it began in text already sent),
        None while it has not been written."""
        marker = self._calls_marker
        if not marker:
            return None
        sent = self.text[-(len(marker) - 1):] if len(marker) > 1 else ""
        found = (sent + self._pending).find(marker)
        return None if found < 0 else max(0, found - len(sent))

    def _emit(self, upto: int) -> str:
        delta, self._pending = self._pending[:upto], self._pending[upto:]
        self.text += delta
        return delta
