"""The registry snapshot held in memory, refreshed in the background; the router's own health.

Which view requests are placed with:
- the registry's snapshot, while it is fresh (taken in within `max_age_s`);
- the last good snapshot, as it is, when the registry cannot be reached, or answers with a view in
  which no site is alive although ours had live sites (a registry back from an outage whose sites
  have not heartbeated yet: the router keeps its last good view until the new one has live sites);
- past `max_age_s` that last good snapshot is no longer trusted alone: the router checks the sites it
  knows directly (agent `Health`, site_checks.py) and places only on those that pass, with the load
  figures they report themselves. So a registry outage of any length costs no request while the
  sites are healthy, and a site that dies meanwhile is dropped within a few check intervals.

The refresh task never dies: every failure is caught, counted and logged (the first of a streak,
then at most once a minute), the next try backs off (`registry.retry.Backoff`, doubling from twice
`refresh_s` up to 5 s), and a task that ends anyway is started again. Site checks run in a second
task, supervised alike. With several registry replicas the client moves to the next within a call.

Health (`status()`, served as /healthz). A load balancer drops an unhealthy router, and a registry
outage is shared by every router: reporting it would drop them all while they are all serving. So
a router is unhealthy (503, with the reason) only for what is its own:
- it has no site list at all (it has not reached the registry since it started);
- its snapshot is older than `max_age_s` because its feed fails while the registry answers (a
  document it cannot take in, a bug), or its refresh task is not running.
While the registry is unreachable or warming up, the router is healthy and says so: `registry`
names the state, `view` the view it places with, `live_sites` how many sites that view offers.

A registry that answers with a body that does not decode (deflate data that does not inflate, a body
that is not JSON) is `bad_encoding`, not `unreachable`: the registry is up, and what it or a proxy in
front of it sends is broken, which an operator looks for elsewhere than a down registry. Every router
gets the same body, so like an outage it leaves the router healthy, placing with its last good view;
it is logged as an error.

A registry that answers the poll with an error is named by that answer, not `unreachable` either:
`unauthorized` for 401 and 403 (the registry does not take this router's `registry_token`: a
configuration to fix, logged as an error, which no waiting cures) and `error_status` for any other
error status (a 5xx of the registry or of a proxy in front of it; the status and message are in
`last_error`). `unreachable` stays for no answer at all: a refused connection, a timeout, a name that
does not resolve. Each failed refresh is counted by that reason (`failures_by_reason`, exported as
`edgefire_router_snapshot_failures_total{reason}` by router.metrics).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from registry.client import RegistryError
from registry.retry import Backoff
from router.errors import no_capacity
from router.site_checks import SiteChecks
from router.snapshot import Snapshot, parse_snapshot

log = logging.getLogger(__name__)

FetchSnapshot = Callable[[str | None], Awaitable[tuple[dict | None, str | None]]]
MAX_BACKOFF_S = 5.0
LOG_EVERY_S = 60.0  # while failures go on, one log line per this many seconds

# Registry states, as /healthz reports them.
REGISTRY_OK = "ok"
REGISTRY_UNREACHABLE = "unreachable"
REGISTRY_WARMING_UP = "warming_up"   # answers, but with no live site yet: heartbeats are resuming
REGISTRY_BAD_ENCODING = "bad_encoding"  # answers, but with a body that does not decode
REGISTRY_UNAUTHORIZED = "unauthorized"  # answers 401 or 403: it does not take this router's registry_token
REGISTRY_ERROR_STATUS = "error_status"  # answers with another error status (a 5xx, a proxy's 404)
FEED_ERROR = "feed_error"            # answers, but this router cannot take its snapshot in
# Why a refresh failed: the states above that are failures, each counted from the router's start.
FAILURE_REASONS = (REGISTRY_UNREACHABLE, REGISTRY_UNAUTHORIZED, REGISTRY_ERROR_STATUS, REGISTRY_BAD_ENCODING,
                   FEED_ERROR)
UNAUTHORIZED_STATUSES = (401, 403)


@dataclass(slots=True)
class FeedStatus:
    healthy: bool
    reason: str | None
    registry: str
    view: str                     # registry | last_good | checked | none
    snapshot_age_s: float | None
    live_sites: int
    num_refresh_errors: int
    last_error: str | None

    def body(self) -> dict:
        body = {"ok": self.healthy, "registry": self.registry, "view": self.view,
                "snapshot_age_s": None if self.snapshot_age_s is None else round(self.snapshot_age_s, 3),
                "live_sites": self.live_sites, "num_refresh_errors": self.num_refresh_errors}
        if self.reason:
            body["reason"] = self.reason
        if self.last_error:
            body["last_error"] = self.last_error
        return body


class SnapshotFeed:
    def __init__(self, fetch: FetchSnapshot, refresh_s: float = 1.0, max_age_s: float = 60.0,
                 checks: SiteChecks | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self._refresh_s = refresh_s
        self._max_age_s = max_age_s
        self._checks = checks
        self._clock = clock
        self._good: Snapshot | None = None      # the last snapshot taken in with live sites (or the first)
        self._good_at = 0.0
        self._checked: Snapshot | None = None   # _good with direct site checks applied, once past max age
        self._etag: str | None = None
        self._held_back = False                 # the last document fetched (etag) was not taken in
        self._registry = REGISTRY_OK
        self._last_error: str | None = None
        self.failures_by_reason = dict.fromkeys(FAILURE_REASONS, 0)
        self._streak = 0                        # failed refreshes in a row
        self._backoff = Backoff(initial_s=2 * refresh_s, max_s=max(refresh_s, MAX_BACKOFF_S))
        self._last_logged = -math.inf
        self._tasks: dict[str, asyncio.Task] = {}
        self._stopping = False
        self._refreshing = asyncio.Lock()      # one refresh at a time (its parse runs on a worker thread)

    # -- lifetime ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._stopping = False
        await self.refresh()  # a down registry at start is not fatal: requests get 503 until it answers
        self._spawn("snapshot-refresh", self._refresh_loop)
        if self._checks is not None:
            self._spawn("site-checks", self._check_loop)

    async def stop(self) -> None:
        self._stopping = True
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        task = self._tasks[name] = asyncio.create_task(loop(), name=name)
        task.add_done_callback(lambda done: self._restart(name, loop, done))

    def _restart(self, name: str, loop: Callable[[], Awaitable[None]], task: asyncio.Task) -> None:
        if self._stopping or self._tasks.get(name) is not task:
            return
        error = None if task.cancelled() else task.exception()
        log.error("the %s task ended (%r); starting it again", name, error or "cancelled")
        self._spawn(name, loop)

    # -- refresh -----------------------------------------------------------------------------

    async def refresh(self) -> bool:
        """One fetch from the registry; never raises. True when the registry's answer was taken in.
        The document is parsed on a worker thread: a fleet of hundreds of sites takes milliseconds to
        parse, which on the event loop would hold up every stream the router relays meanwhile. One
        refresh runs at a time, so a slow parse never adopts an older snapshot after a newer one."""
        async with self._refreshing:
            try:
                document, etag = await self._fetch(self._etag)
            except (httpx.DecodingError, json.JSONDecodeError, UnicodeDecodeError) as exc:
                self._failed(REGISTRY_BAD_ENCODING, f"registry snapshot does not decode: {type(exc).__name__}: {exc}")
                return False
            except RegistryError as exc:
                if exc.code == REGISTRY_BAD_ENCODING:  # the client's own check of a deflated body
                    self._failed(REGISTRY_BAD_ENCODING, f"registry snapshot does not decode: {exc}")
                elif exc.status in UNAUTHORIZED_STATUSES:
                    self._failed(REGISTRY_UNAUTHORIZED, f"registry refused this router's registry_token: {exc}")
                else:
                    self._failed(REGISTRY_ERROR_STATUS, f"registry snapshot poll failed: {exc}")
                return False
            except httpx.HTTPError as exc:
                self._failed(REGISTRY_UNREACHABLE, f"registry unreachable: {exc}")
                return False
            except Exception as exc:
                self._failed(FEED_ERROR, f"snapshot fetch failed: {type(exc).__name__}: {exc}", exc)
                return False
            try:
                self._take(None if document is None else await asyncio.to_thread(parse_snapshot, document), etag)
            except Exception as exc:
                self._failed(FEED_ERROR, f"snapshot not taken in: {type(exc).__name__}: {exc}", exc)
                return False
            return True

    def _take(self, snapshot: Snapshot | None, etag: str | None) -> None:
        """A parsed snapshot, or None for the registry's 304 (the one we hold is still current)."""
        if snapshot is not None:
            self._held_back = self._warming_up(snapshot)
            if not self._held_back:
                self._adopt(snapshot)
        elif not self._held_back:  # 304: the snapshot we hold is still the registry's
            self._good_at = self._clock()
        self._etag = etag
        self._succeeded(REGISTRY_WARMING_UP if self._held_back else REGISTRY_OK)

    def _warming_up(self, snapshot: Snapshot) -> bool:
        """No site alive in `snapshot`, though sites it lists were alive in ours: the registry is back
        before their heartbeats are (registry/snapshot.py gives them a window, this covers the rest)."""
        if self._good is None or any(site.alive for site in snapshot.sites):
            return False
        ours = {site.name for site in self._good.sites if site.alive}
        return any(site.name in ours for site in snapshot.sites)

    def _adopt(self, snapshot: Snapshot) -> None:
        self._good, self._good_at, self._checked = snapshot, self._clock(), None
        if self._checks is not None:
            self._checks.forget()

    def _succeeded(self, state: str) -> None:
        if self._streak or state != self._registry:
            log.warning("registry snapshot refresh: %s after %d failed refresh(es)%s", state, self._streak,
                        "; keeping the last good view until its sites are live" if state == REGISTRY_WARMING_UP else "")
        self._registry, self._streak = state, 0
        self._backoff.reset()

    @property
    def num_errors(self) -> int:
        """Failed refreshes since the router started, whatever their reason."""
        return sum(self.failures_by_reason.values())

    def _failed(self, state: str, message: str, exc: Exception | None = None) -> None:
        self.failures_by_reason[state] += 1
        self._streak += 1
        now = self._clock()
        if self._streak == 1 or state != self._registry or now - self._last_logged >= LOG_EVERY_S:
            self._last_logged = now
            log.log(logging.ERROR if state in (FEED_ERROR, REGISTRY_BAD_ENCODING, REGISTRY_UNAUTHORIZED)
                    else logging.WARNING,
                    "%s (%d failed refresh(es) in a row, %d in all); placing with the last good snapshot",
                    message, self._streak, self.num_errors, exc_info=exc if self._streak == 1 else None)
        self._registry, self._last_error = state, message

    def _next_delay_s(self) -> float:
        return self._backoff.next_delay() if self._streak else self._refresh_s

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self._next_delay_s())
            await self.refresh()

    # -- direct checks -----------------------------------------------------------------------

    async def _check_loop(self) -> None:
        while True:
            try:
                await self.check_sites()
            except Exception:  # a bug here must not end the checks: the next round tries again
                log.exception("direct site checks failed")
            await asyncio.sleep(self._checks.interval_s)

    async def check_sites(self) -> None:
        """One round of direct checks, when the last good snapshot is too old to trust alone."""
        good = self._good
        if good is None or not self.stale():
            return
        checked = await self._checks.check(good)
        if self._good is good and self.stale():
            self._checked = checked

    # -- reading -----------------------------------------------------------------------------

    def stale(self) -> bool:
        return self.age_s() > self._max_age_s

    def current(self) -> Snapshot:
        """The view to place with, or an ApiError (503) when there is none."""
        if self._good is None:
            raise no_capacity("The router has no site list from the registry yet; retry shortly.", 5.0)
        if self.stale() and self._checked is not None:
            return self._checked
        return self._good

    def age_s(self) -> float:
        return self._clock() - self._good_at if self._good is not None else math.inf

    def status(self) -> FeedStatus:
        age = self.age_s() if self._good is not None else None
        reason = None
        if self._good is None:
            reason = "no site list from the registry yet"
        elif self.stale() and self._registry == FEED_ERROR:
            reason = f"the snapshot feed fails while the registry answers; the snapshot is {age:.0f} s old"
        elif "snapshot-refresh" in self._tasks and self._tasks["snapshot-refresh"].done():
            reason = "the snapshot refresh task is not running"
        view = "none" if self._good is None else (
            "checked" if self.stale() and self._checked is not None else
            "registry" if self._registry == REGISTRY_OK else "last_good")
        live_sites = 0 if self._good is None else sum(1 for site in self.current().sites if site.alive)
        return FeedStatus(reason is None, reason, self._registry, view, age, live_sites, self.num_errors,
                          self._last_error if self._registry != REGISTRY_OK else None)
