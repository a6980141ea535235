"""The registry snapshot held in memory and refreshed in the background.

A failed refresh keeps the last-known-good snapshot. Once it is older than `max_age_s` the feed
either keeps serving it (fail-open: stale placement beats none, and passive health still steers
around dead sites) or refuses (fail-closed: every request gets a 503 until the registry is back).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from registry.client import RegistryError
from router.errors import no_capacity
from router.snapshot import Snapshot, parse_snapshot

log = logging.getLogger(__name__)

FetchSnapshot = Callable[[str | None], Awaitable[tuple[dict | None, str | None]]]


class SnapshotFeed:
    def __init__(self, fetch: FetchSnapshot, refresh_s: float = 1.0, max_age_s: float = 60.0,
                 fail_open: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self._refresh_s = refresh_s
        self._max_age_s = max_age_s
        self._fail_open = fail_open
        self._clock = clock
        self._snapshot: Snapshot | None = None
        self._etag: str | None = None
        self._fetched_at = 0.0
        self._task: asyncio.Task | None = None
        self._registry_down = False

    async def start(self) -> None:
        await self.refresh()  # a down registry at start is not fatal: requests get 503 until it answers
        self._task = asyncio.create_task(self._loop(), name="snapshot-feed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def refresh(self) -> bool:
        try:
            document, etag = await self._fetch(self._etag)
        except (httpx.HTTPError, RegistryError) as exc:
            if not self._registry_down:
                log.warning("registry snapshot refresh failed (%s); serving last-known-good", exc)
            self._registry_down = True
            return False
        if document is not None:
            self._snapshot = parse_snapshot(document)
        self._etag = etag
        self._fetched_at = self._clock()
        if self._registry_down:
            log.info("registry snapshot refresh recovered")
        self._registry_down = False
        return True

    def current(self) -> Snapshot:
        """The snapshot to place with, or an ApiError (503) when there is none to trust."""
        if self._snapshot is None:
            raise no_capacity("The router has no site list from the registry yet; retry shortly.", 5.0)
        if self.age_s() > self._max_age_s and not self._fail_open:
            raise no_capacity("The router has lost contact with the registry; retry shortly.", 5.0)
        return self._snapshot

    def age_s(self) -> float:
        return self._clock() - self._fetched_at

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            await self.refresh()
