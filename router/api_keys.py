"""API keys, checked against the registry and cached briefly.

The cache is keyed by a hash of the key, so the router never holds a table of secrets. Concurrent
requests with one uncached key share a single registry lookup. While the registry is unreachable a
key seen before keeps working on its cached answer; an unknown key then gets a 503, not a 401. A
key whose answer has expired waits at most STALE_WAIT_S for the registry to answer again (a revoked
key is refused at once while the registry is healthy); past that, it is served on its last answer
for STALE_GRACE_S while the lookup goes on, so a registry that hangs (rather than refuses
connections) does not hold every request for the client's whole timeout.

Revocation. A cached key is honoured until its entry expires (`ttl_s`, the router's `api_key_cache_s`)
unless the registry says sooner: every fleet report names the keys it carried that are now revoked
(router/fleet_reporter.py), and `forget` turns their entries into refusals at once. So a revoked key is
refused by every router within about a report interval of its next use there.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from registry.client import RegistryError
from registry.http_head import RepeatedHeader, single_header
from router.errors import ApiError, bad_api_key, no_capacity

log = logging.getLogger(__name__)
NEGATIVE_TTL_S = 5.0
STALE_WAIT_S = 0.25
STALE_GRACE_S = 5.0
# At most this many answers are held, the oldest dropped first. Refusals are also dropped once they
# expire (every NEGATIVE_TTL_S, a sweep): a client trying a new made-up key on every request would
# otherwise add an entry per request for as long as the router runs. Accepted keys stay after they
# expire, since they are the last-known answer while the registry is away; the registry's key table
# bounds them.
MAX_CACHED_KEYS = 100_000


@dataclass(slots=True)
class ApiKey:
    id: int | str
    name: str
    allowed_regions: frozenset[str]
    requests_per_minute: int | None
    tokens_per_minute: int | None


ANONYMOUS = ApiKey("anonymous", "anonymous", frozenset(), None, None)


@dataclass(slots=True)
class _Entry:
    key: ApiKey | None
    expires_at: float


class ApiKeyCache:
    def __init__(self, lookup: Callable[[str], Awaitable[dict | None]], ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, max_entries: int = MAX_CACHED_KEYS) -> None:
        self._lookup = lookup
        self._ttl_s = ttl_s
        self._clock = clock
        self._max_entries = max_entries
        self._entries: dict[bytes, _Entry] = {}   # oldest answer first
        self._pending: dict[bytes, asyncio.Future] = {}
        self._next_sweep = -math.inf

    async def authenticate(self, secret: str | None) -> ApiKey:
        if not secret:
            raise bad_api_key()
        digest = hashlib.sha256(secret.encode()).digest()
        entry = self._entries.get(digest)
        if entry is not None and entry.expires_at > self._clock():
            if entry.key is None:
                raise bad_api_key()
            return entry.key
        pending = self._pending.get(digest)
        if pending is None:
            pending = self._pending[digest] = asyncio.ensure_future(self._refresh(digest, secret, entry))
            pending.add_done_callback(lambda _f: self._pending.pop(digest, None))
        if entry is None:
            key = await asyncio.shield(pending)
        else:
            try:
                key = await asyncio.wait_for(asyncio.shield(pending), STALE_WAIT_S)
            except TimeoutError:  # the registry is slow: the last answer stands until the lookup replaces it
                self._store(digest, _Entry(entry.key, self._clock() + STALE_GRACE_S))
                key = entry.key
        if key is None:
            raise bad_api_key()
        return key

    def forget(self, key_ids: list[int]) -> None:
        """The registry says these keys are revoked: refuse them from now on (401), not after the cache's TTL."""
        revoked = set(key_ids)
        until = self._clock() + min(self._ttl_s, NEGATIVE_TTL_S)
        for digest, entry in list(self._entries.items()):
            if entry.key is not None and entry.key.id in revoked:
                self._entries[digest] = _Entry(None, until)

    async def _refresh(self, digest: bytes, secret: str, stale: _Entry | None) -> ApiKey | None:
        try:
            record = await self._lookup(secret)
        except (httpx.HTTPError, RegistryError) as exc:
            if stale is not None:  # last-known answer while the registry is away, asked again after a grace
                self._store(digest, _Entry(stale.key, self._clock() + STALE_GRACE_S))
                return stale.key
            log.warning("API key lookup failed: %s", type(exc).__name__)
            raise no_capacity("The router cannot verify API keys right now; retry shortly.", 5.0) from exc
        key = None if record is None else parse_api_key(record)
        ttl = self._ttl_s if key is not None else min(self._ttl_s, NEGATIVE_TTL_S)
        self._store(digest, _Entry(key, self._clock() + ttl))
        return key

    def _store(self, digest: bytes, entry: _Entry) -> None:
        self._entries.pop(digest, None)  # re-inserted: the newest answer goes last
        self._entries[digest] = entry
        now = self._clock()
        if now >= self._next_sweep:
            self._next_sweep = now + NEGATIVE_TTL_S
            for expired in [d for d, e in self._entries.items() if e.key is None and e.expires_at <= now]:
                del self._entries[expired]
        while len(self._entries) > self._max_entries:
            del self._entries[next(iter(self._entries))]

    def __len__(self) -> int:
        return len(self._entries)


def parse_api_key(record: dict) -> ApiKey:
    return ApiKey(record["id"], record.get("name", ""), frozenset(record.get("allowed_regions") or ()),
                  record.get("requests_per_minute"), record.get("tokens_per_minute"))


def authorization_header(raw_headers) -> str | None:
    """The one Authorization header's value in ASGI raw headers (lowercase names), None when absent.
    Sent more than once it is refused (401) whichever copy holds the key: which one a hop in between
    added is not knowable (the registry and the agents refuse it alike). One pass, and nothing
    allocated beyond the value's text, since every completion request comes through here."""
    try:
        return single_header(raw_headers, b"authorization")
    except RepeatedHeader:
        raise ApiError(401, "The request has more than one Authorization header; send one "
                            "`Authorization: Bearer <key>`.", "invalid_request_error", None, "invalid_api_key") from None


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None

