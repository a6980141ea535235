"""Registration and heartbeats to the registry, resilient to the registry being away.

The project's one retry policy (`registry.retry.Backoff`) for both: a failed call waits, doubling up
to a cap, then tries again; a success resets it. With several registry URLs the client itself moves
on to the next replica within a call (registry/client.py). Nothing here ever stops serving: the loop only logs, waits and retries.
The heartbeat body is the wire contract's `CapacityReport` (registry.wire), built by
`capacity_report` from the engines' figures, so what the agent sends is what the registry accepts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from registry.client import RegistryClient, RegistryError
from registry.retry import Backoff
from registry.wire import MAX_CACHE_HASHES, CapacityReport, PrefixCacheSummary

if TYPE_CHECKING:  # the agent's engines; only their figures are read here
    from engine.engine import EngineStats

log = logging.getLogger(__name__)


def registry_failure(exc: RegistryError | httpx.HTTPError) -> str:
    """A failed registry call as a log line shows it: httpx's timeouts carry no message at all (a
    registry that accepts connections but never answers logged "registry call failed ()"), so the
    kind of failure and the URL called always lead."""
    if isinstance(exc, RegistryError):
        return str(exc)
    try:
        where = f" on {exc.request.method} {exc.request.url}"
    except RuntimeError:  # an httpx error raised before any request was built
        where = ""
    return f"{type(exc).__name__}{where}" + (f": {exc}" if str(exc) else "")


@dataclass(slots=True)
class Registration:
    name: str
    grpc_address: str
    models: list[dict]
    heartbeat_interval_s: float
    region: str | None = None
    country: str | None = None
    lat: float | None = None
    lon: float | None = None


def capacity_report(block_size: int, draining: bool, engines: Sequence[EngineStats],
                    cached_hashes: Sequence[str]) -> CapacityReport:
    """The site's heartbeat: every engine's figures summed. The prefix-cache hashes (most recently
    used first, per engine) are cut to the contract's maximum rather than refused for the lot."""
    return CapacityReport(
        kv_blocks_total=sum(e.num_blocks_total for e in engines), kv_blocks_free=sum(e.num_blocks_free for e in engines),
        block_size=block_size, num_running=sum(e.num_running for e in engines),
        num_waiting=sum(e.num_waiting for e in engines),
        inflight_prefill_tokens=sum(e.inflight_prefill_tokens for e in engines),
        inflight_decode_tokens=sum(e.inflight_decode_tokens for e in engines),
        prefill_tokens_per_s=float(sum(e.prefill_tokens_per_s for e in engines)),
        decode_tokens_per_s=float(sum(e.decode_tokens_per_s for e in engines)),
        decode_batch_size=float(sum(e.decode_batch_size for e in engines)),
        decode_kv_tokens=float(sum(e.decode_kv_tokens for e in engines)),
        prefix_cache_summary=PrefixCacheSummary(block_size=block_size, hashes=list(cached_hashes[:MAX_CACHE_HASHES])),
        draining=draining,
        num_gpus=sum(e.num_gpus for e in engines),
        # one layout per agent (its config): every engine has it
        tensor_parallel_size=max((e.tensor_parallel_size for e in engines), default=1),
        pipeline_parallel_size=max((e.pipeline_parallel_size for e in engines), default=1),
        expert_parallel_size=max((e.expert_parallel_size for e in engines), default=1),
        speculative_acceptance=sum(e.num_accepted_draft_tokens for e in engines)
        / max(1, sum(e.num_draft_tokens for e in engines)),
    )


class HeartbeatLoop:
    """Registers the site, then reports capacity every interval until stopped."""

    def __init__(self, client: RegistryClient, registration: Registration,
                 capacity: Callable[[], Awaitable[CapacityReport]], on_status: Callable[[dict], None] | None = None):
        self.client = client
        self.registration = registration
        self._capacity = capacity
        self._on_status = on_status
        self._backoff = Backoff(max_s=max(2 * registration.heartbeat_interval_s, 1.0))
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.registered = False
        self.num_heartbeats = 0
        self.num_failures = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="heartbeat")

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                await self._beat()
            except (RegistryError, httpx.HTTPError) as exc:
                self.num_failures += 1
                delay = self._backoff.next_delay()
                log.warning("registry call failed (%s); retrying in %.1fs", registry_failure(exc), delay)
                await self._sleep(delay)
                continue
            self._backoff.reset()
            await self._sleep(self.registration.heartbeat_interval_s)

    async def _beat(self) -> None:
        if not self.registered:
            r = self.registration
            await self.client.register_site(r.name, r.grpc_address, r.models, r.heartbeat_interval_s,
                                            r.region, r.country, r.lat, r.lon)
            self.registered = True
            log.info("registered site %s at %s", r.name, r.grpc_address)
        try:
            status = await self.client.heartbeat((await self._capacity()).to_json())
        except RegistryError as exc:
            if exc.status == 404:
                self.registered = False  # the registry forgot us (e.g. restored from an old copy)
            raise
        self.num_heartbeats += 1
        if self._on_status is not None and isinstance(status, dict):
            self._on_status(status)

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            pass  # the usual case: the interval passed without a stop

    async def beat_now(self) -> None:
        """One heartbeat outside the schedule (e.g. to announce draining); failures are only logged."""
        try:
            await self._beat()
        except (RegistryError, httpx.HTTPError) as exc:
            log.warning("registry call failed (%s)", registry_failure(exc))

    async def stop(self, deregister: bool) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        if deregister:
            try:
                await self.client.deregister()
            except (RegistryError, httpx.HTTPError) as exc:
                log.warning("could not deregister (%s); the registry will age the site out", registry_failure(exc))
        await self.client.aclose()
