"""Registration and heartbeats to the registry, resilient to the registry being away.

The project's one retry policy (`registry.retry.Backoff`) for both: a failed call waits, doubling up
to a cap, then tries again; a success resets it. With several registry URLs the client itself moves
on to the next replica within a call (registry/client.py). Nothing here ever stops serving: the loop only logs, waits and retries.
The one answer that ends it is 410 `site_deleted` (an operator deleted this site; registry/tombstones.py):
`on_site_deleted` is told, and the agent drains and exits (node_agent/daemon.py). Any other refusal, a 401
included, is retried as ever.
The heartbeat body is the wire contract's `CapacityReport` (registry.wire), built by
`site_capacity_report` from each hosted model's engine figures, so what the agent sends is what the
registry accepts: the site's sums, and with several models each model's own KV pool and prefix cache,
the cap on cache hashes shared fairly among them (`hash_shares`). Each summary says how many of its
leading hashes are held (`num_held`: by running sequences or KV leases; the rest are evictable), cut with
the hashes, so a router credits only those against the free KV blocks (registry.wire).
A registry older than the agent refuses the fields it does not know (422): those are left out of
the heartbeats from then on, once each, so an agent can be upgraded before its registry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import httpx

from registry.client import RegistryClient, RegistryError
from registry.retry import Backoff
from registry.wire import MAX_CACHE_HASHES, SUMMARY_FIELDS, CapacityReport, ModelCapacity, PrefixCacheSummary

if TYPE_CHECKING:  # the agent's engines; only their figures are read here
    from engine.engine import EngineStats

log = logging.getLogger(__name__)

UNKNOWN_FIELD = ": is not a field of this request"  # how the registry's 422 names a field it does not know
SITE_DELETED = "site_deleted"  # the registry's code for a token whose site an operator deleted (410)


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


def unknown_field(exc: RegistryError) -> str | None:
    """The optional heartbeat field a registry refused as not one of its fields (its 422 names the first
    such field: registry.http_errors), or None for any other refusal. An optional field of a prefix-cache
    summary, the site's or a model's ("models.<model>.prefix_cache_summary.num_held"), is named as the
    site's (registry.wire.SUMMARY_FIELDS): it is left out of every summary."""
    if exc.status != 422:
        return None
    name, found, _ = exc.message.partition(UNKNOWN_FIELD)
    if not found:
        return None
    head, _, tail = name.rpartition("prefix_cache_summary.")
    if f"prefix_cache_summary.{tail}" in SUMMARY_FIELDS and (head == "" or head.startswith("models.")):
        return f"prefix_cache_summary.{tail}"
    field = CapacityReport.model_fields.get(name)
    return name if field is not None and not field.is_required() else None


def is_site_deleted(exc: BaseException) -> bool:
    return isinstance(exc, RegistryError) and exc.status == 410 and exc.code == SITE_DELETED


def site_deleted_line(exc: RegistryError, site: str) -> str:
    """The one line an agent logs when the registry says its site was deleted: which site, when (UTC) and
    by whom, from the fields of the registry's answer."""
    name = exc.fields.get("site") or site
    deleted_at = exc.fields.get("deleted_at")
    when = (datetime.fromtimestamp(deleted_at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            if isinstance(deleted_at, (int, float)) else "an unknown time")
    actor = exc.fields.get("deleted_by") or "an unknown operator"
    return f"site {name} was deleted from the registry at {when} by {actor}: draining and stopping"


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


def widest_layout(engines: Sequence[EngineStats]) -> tuple[int, int, int]:
    """(tp, pp, ep) of the engine with the most ranks, taken whole: with `model_parallel` the models
    have their own sizes, and the largest of each size taken apart (tp from one model, pp from another)
    would name a layout that no engine runs."""
    def ranks(e: EngineStats) -> int:
        return max(e.tensor_parallel_size, e.expert_parallel_size) * e.pipeline_parallel_size

    if not engines:
        return 1, 1, 1
    widest = max(engines, key=ranks)  # the first of equals: the models' configured order
    return widest.tensor_parallel_size, widest.pipeline_parallel_size, widest.expert_parallel_size


@dataclass(slots=True)
class ModelFigures:
    """One hosted model's engine, as a heartbeat reads it: its figures and its prefix-cache hashes
    (16 hex digits each, most recently used first), the first `num_held` of them held (engine
    cache_summary; None: not known, read as all held)."""

    stats: EngineStats
    cached_hashes: Sequence[str] = ()
    num_held: int | None = None


def hash_shares(counts: Sequence[int], budget: int) -> list[int]:
    """How many of its hashes each model sends within `budget`: an equal share each, and what a model
    with fewer leaves goes to the others (the smallest take theirs first)."""
    shares, left = [0] * len(counts), budget
    for num_served, i in enumerate(sorted(range(len(counts)), key=counts.__getitem__)):
        shares[i] = min(counts[i], left // (len(counts) - num_served))
        left -= shares[i]
    return shares


def site_capacity_report(block_size: int, draining: bool, models: Mapping[str, ModelFigures]) -> CapacityReport:
    """The heartbeat of a site hosting `models`. With one model its figures are the site's, sent as ever.
    With several, the site's sums, and each model's own KV pool and prefix cache under `models` (a
    request needs room in its own model's pool, and a cached prefix serves only the model that cached
    it); the cap on hashes is shared among the models, so none is cut off."""
    engines = [figures.stats for figures in models.values()]
    if len(models) <= 1:
        only = next(iter(models.values()), None)
        return capacity_report(block_size, draining, engines, only.cached_hashes if only else (),
                               num_held=only.num_held if only else None)
    shares = hash_shares([len(figures.cached_hashes) for figures in models.values()], MAX_CACHE_HASHES)
    own = {name: ModelCapacity(kv_blocks_total=figures.stats.num_blocks_total,
                               kv_blocks_free=figures.stats.num_blocks_free,
                               prefix_cache_summary=cache_summary(block_size, figures.cached_hashes, figures.num_held,
                                                                  share))
           for (name, figures), share in zip(models.items(), shares)}
    return capacity_report(block_size, draining, engines, (), own)


def capacity_report(block_size: int, draining: bool, engines: Sequence[EngineStats],
                    cached_hashes: Sequence[str], models: dict[str, ModelCapacity] | None = None,
                    num_held: int | None = None) -> CapacityReport:
    """The site's heartbeat: every engine's load and KV figures summed (each engine has a KV pool of
    its own), the distinct GPUs its engines run on (each engine's `gpu_indices`, as it placed its ranks:
    models of one agent start from the same configured device, so engines sharing a GPU count it once)
    and the widest engine's layout; `models`: each model's own figures (site_capacity_report).
    kv_blocks_free counts the blocks queued requests will take (EngineStats.num_blocks_waiting) as free, as the pool
    does: routers filter sites by it and answer 503 at once when none passes, while the agent's refusal of a
    request those queued ones leave no room for is waited on (router.generation); the queue itself reaches
    routers as num_waiting and inflight_prefill_tokens, which their cost model prices.
    The prefix-cache hashes (most recently used first, per engine; the first `num_held` held) are cut to
    the contract's maximum rather than refused for the lot."""
    tp, pp, ep = widest_layout(engines)
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
        prefix_cache_summary=cache_summary(block_size, cached_hashes, num_held, MAX_CACHE_HASHES),
        draining=draining,
        num_gpus=len({index for e in engines for index in e.gpu_indices}),
        tensor_parallel_size=tp, pipeline_parallel_size=pp, expert_parallel_size=ep,
        speculative_acceptance=sum(e.num_accepted_draft_tokens for e in engines)
        / max(1, sum(e.num_draft_tokens for e in engines)),
        models=models,
    )


def cache_summary(block_size: int, cached_hashes: Sequence[str], num_held: int | None,
                  limit: int) -> PrefixCacheSummary:
    """A prefix-cache summary of the first `limit` hashes: the held ones lead, so the cut keeps `num_held`
    true of what is sent."""
    return PrefixCacheSummary(block_size=block_size, hashes=list(cached_hashes[:limit]),
                              num_held=None if num_held is None else min(num_held, len(cached_hashes), limit))


class HeartbeatLoop:
    """Registers the site, then reports capacity every interval until stopped, or until the registry says
    the site was deleted: then `on_site_deleted` gets the line to log (logged here when none is given),
    and the registry is not called again."""

    def __init__(self, client: RegistryClient, registration: Registration,
                 capacity: Callable[[], Awaitable[CapacityReport]], on_status: Callable[[dict], None] | None = None,
                 on_site_deleted: Callable[[str], None] | None = None):
        self.client = client
        self.registration = registration
        self._capacity = capacity
        self._on_status = on_status
        self._on_site_deleted = on_site_deleted
        self.site_deleted = False
        self._backoff = Backoff(max_s=max(2 * registration.heartbeat_interval_s, 1.0))
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.registered = False
        self.num_heartbeats = 0
        self.num_failures = 0
        self.left_out: set[str] = set()  # heartbeat fields the registry refused as unknown

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="heartbeat")

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                await self._beat()
            except (RegistryError, httpx.HTTPError) as exc:
                if self._deleted(exc):
                    return
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
            status = await self._send(await self._capacity())
        except RegistryError as exc:
            if exc.status == 404:
                self.registered = False  # the registry forgot us (e.g. restored from an old copy)
            raise
        self.num_heartbeats += 1
        if self._on_status is not None and isinstance(status, dict):
            self._on_status(status)

    async def _send(self, report: CapacityReport):
        """The heartbeat, less the fields the registry said it does not know: an agent upgraded before its
        registry would otherwise be refused every heartbeat, and its site never be placed on."""
        while True:
            try:
                return await self.client.heartbeat(report.to_json(self.left_out))
            except RegistryError as exc:
                field = unknown_field(exc)
                if field is None or field in self.left_out:
                    raise
                self.left_out.add(field)
                log.warning("the registry does not know the heartbeat field %s (it is older than this agent); "
                            "heartbeats leave it out", field)

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            pass  # the usual case: the interval passed without a stop

    def _deleted(self, exc: RegistryError | httpx.HTTPError) -> bool:
        """Whether `exc` says the site was deleted; if so, the first time, tells `on_site_deleted`."""
        if not is_site_deleted(exc):
            return False
        if not self.site_deleted:
            self.site_deleted = True
            line = site_deleted_line(exc, self.registration.name)
            if self._on_site_deleted is None:
                log.error("%s", line)
            else:
                self._on_site_deleted(line)
        return True

    async def beat_now(self) -> None:
        """One heartbeat outside the schedule (e.g. to announce draining); failures are only logged.
        Nothing is sent once the registry said the site was deleted."""
        if self.site_deleted:
            return
        try:
            await self._beat()
        except (RegistryError, httpx.HTTPError) as exc:
            if not self._deleted(exc):
                log.warning("registry call failed (%s)", registry_failure(exc))

    async def stop(self, deregister: bool) -> None:
        self._stop.set()
        if self._task is not None:
            # A beat in flight is dropped, not awaited: one waiting on an engine that died with the figures
            # asked of it never ends, and the agent (leaving anyway) would never stop for its supervisor.
            self._task.cancel()
            await asyncio.wait([self._task])
        if deregister and not self.site_deleted:  # a deleted site has no registration left to remove
            try:
                await self.client.deregister()
            except (RegistryError, httpx.HTTPError) as exc:
                log.warning("could not deregister (%s); the registry will age the site out", registry_failure(exc))
        await self.client.aclose()
