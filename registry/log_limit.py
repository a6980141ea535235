"""Rate-limited log lines for what a remote party can make happen over and over (rejected
heartbeats, unparsable snapshot sites): the first occurrence of each kind is logged in one line,
repeats within `interval_s` are counted and reported with the next line, never one line each.

    rejections = LogLimiter(log, interval_s=10.0)
    rejections.warning(site_name, "heartbeat from site %s rejected: %s", site_name, reason)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

MAX_KEYS = 4096  # distinct keys remembered; past this the oldest are forgotten


class LogLimiter:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[Hashable, tuple[float, int]] = {}  # key -> (when last logged, repeats since)

    def warning(self, key: Hashable, message: str, *args) -> bool:
        return self.log(logging.WARNING, key, message, *args)

    def log(self, level: int, key: Hashable, message: str, *args) -> bool:
        """Logs unless `key` was logged less than interval_s ago; True when a line was written."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self._interval_s:
            self._last[key] = (last[0], last[1] + 1)
            return False
        if last is not None and last[1]:
            message += f" ({last[1]} more like it in the last {now - last[0]:.0f}s)"
        self._last.pop(key, None)
        self._last[key] = (now, 0)
        if len(self._last) > MAX_KEYS:
            del self._last[next(iter(self._last))]  # dicts keep insertion order: this is the oldest
        self._logger.log(level, message, *args)
        return True
