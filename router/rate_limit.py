"""Per-API-key token buckets for requests per minute and tokens per minute.

Tokens are charged up front (prompt + max_tokens, the most a request can use) and the unused part
refunded when it finishes, so concurrent requests cannot overshoot the limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenBucket:
    capacity: float
    refill_per_s: float
    level: float
    updated_at: float

    def take(self, amount: float, now: float) -> float:
        """Takes `amount` and returns 0, or takes nothing and returns seconds until it would fit."""
        self.level = min(self.capacity, self.level + (now - self.updated_at) * self.refill_per_s)
        self.updated_at = now
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.capacity:
            return 60.0  # never fits one minute's allowance; the caller should send less
        return (amount - self.level) / self.refill_per_s

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


@dataclass(slots=True)
class RateLimiter:
    clock: Callable[[], float] = time.monotonic
    _requests: dict[int | str, TokenBucket] = field(default_factory=dict)
    _tokens: dict[int | str, TokenBucket] = field(default_factory=dict)

    def admit(self, key_id: int | str, requests_per_minute: int | None, tokens_per_minute: int | None,
              num_tokens: int) -> tuple[float, str]:
        """(0, "") when admitted (and charged); else (retry_after_s, "requests" | "tokens")."""
        now = self.clock()
        request_bucket = self._bucket(self._requests, key_id, requests_per_minute, now)
        token_bucket = self._bucket(self._tokens, key_id, tokens_per_minute, now)
        if request_bucket is not None:
            wait = request_bucket.take(1, now)
            if wait:
                return wait, "requests"
        if token_bucket is not None:
            wait = token_bucket.take(num_tokens, now)
            if wait:
                if request_bucket is not None:
                    request_bucket.give_back(1)
                return wait, "tokens"
        return 0.0, ""

    def refund_tokens(self, key_id: int | str, num_tokens: int) -> None:
        bucket = self._tokens.get(key_id)
        if bucket is not None and num_tokens > 0:
            bucket.give_back(num_tokens)

    @staticmethod
    def _bucket(buckets: dict, key_id, per_minute: int | None, now: float) -> TokenBucket | None:
        if not per_minute:
            buckets.pop(key_id, None)
            return None
        bucket = buckets.get(key_id)
        if bucket is None or bucket.capacity != per_minute:  # a changed limit starts a fresh bucket
            bucket = buckets[key_id] = TokenBucket(per_minute, per_minute / 60.0, per_minute, now)
        return bucket
