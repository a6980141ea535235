"""Direct site checks: the router's own view of its sites while the registry's is too old to trust.

During a registry outage (or while a returning registry has no live site yet, see snapshot_feed.py)
the router keeps placing with its last good snapshot. To keep that view honest it asks every site
that was alive in it for its agent `Health`, every `interval_s`, and builds a checked view:

- a site that answers SERVING (or DRAINING) stays, with the load figures it reported itself
  (KV blocks total and free, running and waiting sequences, draining) in place of the snapshot's
  aging ones, and a heartbeat age of zero (the check is the heartbeat);
- a site that fails `failures_to_drop` checks in a row (unreachable, timeout, NOT_SERVING, or a
  different site answering at that address) is dropped (alive = False) until it passes again.

Measured rates, the prefix-cache summary and links keep their snapshot values: the agent's Health
does not carry them, and they age slowly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from node_agent.proto import agent_pb2
from registry.wire import SnapshotCapacity
from router.snapshot import Site, Snapshot

log = logging.getLogger(__name__)

CheckHealth = Callable[[str, float], Awaitable[agent_pb2.HealthResponse]]  # (grpc address, timeout_s)
MAX_CONCURRENT_CHECKS = 64


@dataclass(slots=True)
class SiteCheck:
    health: agent_pb2.HealthResponse | None = None  # the last answer that passed
    num_failures: int = 0                           # failed checks in a row
    reason: str = ""                                # why the last check failed


class SiteChecks:
    def __init__(self, check_health: CheckHealth, interval_s: float = 2.0, timeout_s: float = 2.0,
                 failures_to_drop: int = 2) -> None:
        self._check_health = check_health
        self.interval_s = interval_s
        self._timeout_s = timeout_s
        self._failures_to_drop = failures_to_drop
        self._checks: dict[str, SiteCheck] = {}
        self._limit = asyncio.Semaphore(MAX_CONCURRENT_CHECKS)

    def forget(self) -> None:
        """The registry's view is trusted again: the next outage starts from it, not from old checks."""
        self._checks.clear()

    async def check(self, snapshot: Snapshot) -> Snapshot:
        """One round over the sites alive in `snapshot`; returns the checked view."""
        sites = [site for site in snapshot.sites if _checkable(site)]
        await asyncio.gather(*(self._check_one(site) for site in sites))
        known = {site.name for site in sites}
        for name in [n for n in self._checks if n not in known]:
            del self._checks[name]
        return self.view(snapshot)

    def view(self, snapshot: Snapshot) -> Snapshot:
        """`snapshot` with the checked sites' own load figures, and the failing ones dropped."""
        return replace(snapshot, sites=[self._checked_site(site) for site in snapshot.sites])

    def num_dropped(self) -> int:
        return sum(1 for check in self._checks.values() if check.num_failures >= self._failures_to_drop)

    async def _check_one(self, site: Site) -> None:
        check = self._checks.setdefault(site.name, SiteCheck())
        async with self._limit:
            reason = await self._failure(site)
        if reason is None:
            if check.num_failures >= self._failures_to_drop:
                log.warning("site %s passes its direct health check again; serving it", site.name)
            check.num_failures, check.reason = 0, ""
            return
        check.num_failures += 1
        check.reason = reason
        if check.num_failures == self._failures_to_drop:
            log.warning("site %s failed %d direct health checks (%s); dropped until it passes again",
                        site.name, check.num_failures, reason)

    async def _failure(self, site: Site) -> str | None:
        """None when the site passes, else why not; keeps the passing answer."""
        started = time.monotonic()
        try:
            health = await asyncio.wait_for(self._check_health(site.grpc_address, self._timeout_s), self._timeout_s)
        except asyncio.TimeoutError:
            return f"no answer within {self._timeout_s:g} s"
        except Exception as exc:  # any failure to get an answer is a failed check: grpc errors, refused, reset
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        if health.status == agent_pb2.HealthResponse.NOT_SERVING:
            return "the agent reports NOT_SERVING"
        if health.site and health.site != site.name:
            return f"the agent at {site.grpc_address} is site {health.site!r}"
        log.debug("site %s passed its direct check in %.3f s", site.name, time.monotonic() - started)
        self._checks[site.name].health = health
        return None

    def _checked_site(self, site: Site) -> Site:
        check = self._checks.get(site.name)
        if check is None or not _checkable(site):
            return site
        if check.num_failures >= self._failures_to_drop:
            return replace(site, alive=False)
        if check.health is None:
            return site  # not answered yet, not failed enough to drop: the snapshot's word stands
        return replace(site, heartbeat_age_s=0.0, capacity=_capacity_from_health(site.capacity, check.health))


def _checkable(site: Site) -> bool:
    return site.alive and site.capacity is not None and bool(site.grpc_address)


def _capacity_from_health(capacity: SnapshotCapacity, health: agent_pb2.HealthResponse) -> SnapshotCapacity:
    return capacity.model_copy(update={
        "kv_blocks_total": health.kv_blocks_total, "kv_blocks_free": health.kv_blocks_free,
        "num_running": health.num_running, "num_waiting": health.num_waiting,
        "draining": health.status == agent_pb2.HealthResponse.DRAINING})
