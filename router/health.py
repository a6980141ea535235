"""Passive health: a site that fails `failures_to_cool_down` times in a row cools down for a while.

Cooling sites are ranked last by placement, not removed: when everything is cooling a request
still gets tried somewhere. One success ends the streak.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class PassiveHealth:
    failures_to_cool_down: int = 3
    cooldown_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    _streaks: dict[str, int] = field(default_factory=dict)
    _cool_until: dict[str, float] = field(default_factory=dict)

    def record_failure(self, site: str) -> None:
        streak = self._streaks.get(site, 0) + 1
        self._streaks[site] = streak
        if streak >= self.failures_to_cool_down:
            self._cool_until[site] = self.clock() + self.cooldown_s
            self._streaks[site] = 0

    def record_success(self, site: str) -> None:
        self._streaks.pop(site, None)
        self._cool_until.pop(site, None)

    def cooling(self) -> frozenset[str]:
        if not self._cool_until:
            return frozenset()
        now = self.clock()
        for site in [s for s, until in self._cool_until.items() if until <= now]:
            del self._cool_until[site]
        return frozenset(self._cool_until)
