"""The one retry helper: `Backoff`, a delay that doubles after each failure up to a cap, with jitter.

Every loop that calls the registry again after a failure waits `next_delay()` and calls `reset()` on
success: agents' heartbeats, routers' snapshot refresh and fleet reports, and the registry client
itself, which rests a replica that failed before trying it again (registry/client.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(slots=True)
class Backoff:
    initial_s: float = 0.2
    max_s: float = 10.0
    factor: float = 2.0
    jitter: float = 0.2   # each delay is drawn within ±20% so many callers do not retry in lockstep
    _next_s: float = 0.0

    def next_delay(self) -> float:
        self._next_s = min(self.max_s, self._next_s * self.factor if self._next_s else self.initial_s)
        return self._next_s * random.uniform(1.0 - self.jitter, 1.0 + self.jitter)

    def reset(self) -> None:
        self._next_s = 0.0
