"""Where each session last ran, as this router saw it: the `session_pair` placement keeps it on.

A session is keyed by `x-session-affinity`, else the OpenAI `user` field, within one API key (two
customers' "user-1" are different sessions). The table is bounded (least recently used out
first) and forgets a session idle for `ttl_s` (dropped as newer sessions come); a forgotten
session is placed like a new one, by rendezvous hash, which every router agrees on.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


def session_key(api_key_id: int | str, header: str | None, user: str | None) -> str | None:
    """The session a request belongs to, or None when it names none."""
    name = header or user
    return f"{api_key_id}\x00{name}" if name else None


class SessionTable:
    def __init__(self, max_sessions: int = 100_000, ttl_s: float = 1800.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._max_sessions = max_sessions
        self._ttl_s = ttl_s
        self._clock = clock
        self._pairs: OrderedDict[str, tuple[tuple[str, str], float]] = OrderedDict()

    def pair(self, key: str | None) -> tuple[str, str] | None:
        """The (prefill, decode) sites the session last ran on, if it ran recently."""
        if key is None:
            return None
        found = self._pairs.get(key)
        if found is None:
            return None
        if self._clock() - found[1] > self._ttl_s:
            del self._pairs[key]
            return None
        return found[0]

    def remember(self, key: str | None, prefill_site: str, decode_site: str) -> None:
        if key is None:
            return
        now = self._clock()
        self._pairs[key] = ((prefill_site, decode_site), now)
        self._pairs.move_to_end(key)
        # Oldest first, so the sessions idle past the TTL are at the front: gone now, not when pushed
        # out by the cap, which a router serving far fewer sessions would hold forever.
        while self._pairs and (len(self._pairs) > self._max_sessions
                               or now - next(iter(self._pairs.values()))[1] > self._ttl_s):
            self._pairs.popitem(last=False)

    def __len__(self) -> int:
        return len(self._pairs)
