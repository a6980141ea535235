"""The prefill/decode pool planner: per region, it moves sites that are allowed both roles between
the prefill pool and the decode pool as the load shifts, so the two scale independently.

Inputs, per region, from the routers' snapshot (so the planner sees what placement sees):
  prefill backlog   queued prefill tokens ÷ prefill rate of the sites doing prefill, in seconds
  decode pressure   inter-token time of the sites doing decode (running sequences ÷ decode rate)
                    and how full their KV pools are
Each becomes a pressure, 1.0 at its target. Decisions, with hysteresis:
  prefill ≥ high and decode < high    one flexible site → prefill
  decode ≥ high and prefill < high    one flexible site → decode
  both < low                          one narrowed site → both roles again
  otherwise                           no change (the band between low and high holds the state)
and never faster than:
  min_dwell_s   since that site's last change (read from the database, so it survives restarts)
  settle_s      since any change in the region (the heartbeats must show its effect first)
A site is only narrowed while, for every model it serves in the role it gives up, another live site
in its region keeps doing that role for that model; when that other site dies, is cordoned or drained
later, the narrowed site goes back to both roles at the next tick, dwell and settle notwithstanding
(they hold back load-driven moves, not the repair of a role nobody in the region does any more).
The operator's allowed roles bound the planner: narrowing a site's roles to one drops its pick in the
same change (registry.sites), and the planner never moves a site that does not offer both.

Every change is one `site.active_role` audit entry with its reason and the figures behind it;
`dry_run` only logs what it would do. Routers place by the active role from their next snapshot;
the agent learns it from its next heartbeat's answer, finishes what it has and then refuses the
other role's new work. One planner is active at a time however many registry processes run: each
tick starts by taking or renewing a lease row (registry.leases), and each role change checks that
lease again in its own transaction: a planner that stalled past its lease writes nothing and logs
that it lost it. A dry run takes a lease of its own, so a preview beside the real planner never holds
that one back. Which roles a site offers is the snapshot's `role_offer` (registry.wire), the same
field the routers, `edgefire status` and the dashboard read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy.exc import SQLAlchemyError

from registry.errors import RegistryStoreError
from registry.leases import LeaseClaim, LeaseLost
from registry.log_limit import LogLimiter
from registry.store import RegistryStore
from registry.wire import RoleOffer, read_role_offer
from typed_config import ConfigError

log = logging.getLogger(__name__)
_db_errors = LogLimiter(log, interval_s=60.0)

LEASE_NAME = "planner"
# A dry run previews beside the real planner (another replica, say): with the real one's lease it
# would keep that planner from acting for as long as it ran, so it takes a lease of its own.
DRY_RUN_LEASE_NAME = "planner-dry-run"
ACTOR = "planner"
BOTH = None  # the active role that narrows nothing


@dataclass(slots=True)
class PlannerSettings:
    interval_s: float = 2.0
    min_dwell_s: float = 60.0
    settle_s: float = 10.0
    target_prefill_backlog_s: float = 1.0   # queued prefill beyond this many seconds of work is pressure 1.0
    target_inter_token_s: float = 0.1
    target_kv_used: float = 0.9
    high: float = 1.0
    low: float = 0.5
    default_prefill_tokens_per_s: float = 4000.0  # for sites that have not measured a rate yet
    default_decode_tokens_per_s: float = 500.0
    dry_run: bool = False

    def validate(self) -> None:
        for name in ("interval_s", "min_dwell_s", "settle_s", "target_prefill_backlog_s", "target_inter_token_s",
                     "target_kv_used", "high", "low", "default_prefill_tokens_per_s", "default_decode_tokens_per_s"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"{name}: must be a finite number, got {getattr(self, name)}")
        for name in ("interval_s", "min_dwell_s", "target_prefill_backlog_s", "target_inter_token_s", "target_kv_used",
                     "high", "default_prefill_tokens_per_s", "default_decode_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("settle_s", "low"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.min_dwell_s < self.interval_s:
            raise ConfigError(f"min_dwell_s ({self.min_dwell_s}) must be at least interval_s ({self.interval_s}): a "
                              f"shorter dwell would not hold a site in its pool for even one tick")
        if self.target_kv_used > 1:
            raise ConfigError(f"target_kv_used: the fraction of the KV pool in use, above 0 and at most 1 (0.9 for "
                              f"90%), got {self.target_kv_used}")
        if self.low >= self.high:
            raise ConfigError(f"low ({self.low}) must be below high ({self.high}): the band between them is the hysteresis")


@dataclass(slots=True)
class PoolSite:
    """One site as the planner sees it: its roles are the snapshot's `role_offer` (registry.wire)."""

    name: str
    region: str
    offer: RoleOffer                # what the site takes work in now, the planner's pick included
    unnarrowed: RoleOffer           # what it would take work in with no pick (the same rule, without it)
    active_role: str | None
    active_role_since: float | None
    usable: bool                    # alive, active, not draining
    capacity: dict

    @property
    def flexible(self) -> bool:
        return self.offer.flexible

    @property
    def models(self) -> list[str]:
        return list(self.offer.by_model)

    def does(self, role: str) -> bool:
        return role in self.offer.roles

    def does_for(self, role: str, model: str) -> bool:
        return self.offer.serves(model, role)


@dataclass(slots=True)
class RegionLoad:
    prefill_pressure: float
    decode_pressure: float
    prefill_backlog_s: float
    inter_token_s: float
    kv_used: float

    def figures(self) -> dict:
        return {name: round(getattr(self, name), 4) for name in self.__slots__}


@dataclass(slots=True)
class RoleChange:
    site: str
    region: str
    role: str | None
    reason: str
    load: RegionLoad

    def detail(self) -> dict:
        return {"reason": self.reason, "region": self.region, **self.load.figures()}


def pool_sites(snapshot: dict) -> list[PoolSite]:
    sites = []
    for doc in snapshot.get("sites", ()):
        cap = doc.get("capacity") or {}
        usable = bool(doc.get("alive")) and doc.get("state") == "active" and bool(cap) and not cap.get("draining")
        sites.append(PoolSite(doc["name"], doc.get("region") or "", read_role_offer(doc), _unnarrowed(doc),
                              doc.get("active_role"), doc.get("active_role_since"), usable, cap))
    return sites


def _unnarrowed(doc: dict) -> RoleOffer:
    """The site's offer were the planner's pick dropped: the published offer's rule, without the pick."""
    return read_role_offer({**doc, "role_offer": None, "active_role": BOTH})


def region_load(sites: list[PoolSite], settings: PlannerSettings) -> RegionLoad:
    live = [s for s in sites if s.usable]
    prefill_sites = [s for s in live if s.does("prefill")]
    decode_sites = [s for s in live if s.does("decode")]
    queued = sum(s.capacity.get("inflight_prefill_tokens", 0) for s in live)
    rate = sum(s.capacity.get("prefill_tokens_per_s") or settings.default_prefill_tokens_per_s for s in prefill_sites)
    backlog_s = queued / rate if rate else (float("inf") if queued else 0.0)
    inter_token = [s.capacity.get("num_running", 0) / (s.capacity.get("decode_tokens_per_s")
                                                        or settings.default_decode_tokens_per_s)
                   for s in decode_sites]
    inter_token_s = sum(inter_token) / len(inter_token) if inter_token else 0.0
    kv_used = max((1.0 - s.capacity.get("kv_blocks_free", 0) / max(1, s.capacity.get("kv_blocks_total", 0))
                   for s in decode_sites), default=0.0)
    return RegionLoad(backlog_s / settings.target_prefill_backlog_s,
                      max(inter_token_s / settings.target_inter_token_s, kv_used / settings.target_kv_used),
                      backlog_s, inter_token_s, kv_used)


def plan(snapshot: dict, now: float, settings: PlannerSettings) -> list[RoleChange]:
    """The role changes to make now: at most one per region. Pure: the snapshot and the clock in."""
    by_region: dict[str, list[PoolSite]] = {}
    for site in pool_sites(snapshot):
        by_region.setdefault(site.region, []).append(site)
    changes = []
    for region, sites in sorted(by_region.items()):
        change = _plan_region(region, sites, now, settings)
        if change is not None:
            changes.append(change)
    return changes


def _plan_region(region: str, sites: list[PoolSite], now: float, settings: PlannerSettings) -> RoleChange | None:
    load = region_load(sites, settings)
    repair = _coverage_repair(region, sites, load)
    if repair is not None:
        return repair
    want, reason = _wanted_role(load, settings)
    if want == "hold":
        return None
    last_change = max((s.active_role_since or float("-inf") for s in sites), default=float("-inf"))
    if now - last_change < settings.settle_s:
        return None
    candidates = [s for s in sites if s.flexible and s.usable and s.active_role != want
                  and now - (s.active_role_since or float("-inf")) >= settings.min_dwell_s
                  and (want is BOTH or _role_covered(sites, s, _other(want)))]
    if not candidates:
        return None
    chosen = min(candidates, key=lambda s: _preference(s, want))
    return RoleChange(chosen.name, region, want, reason, load)


def _coverage_repair(region: str, sites: list[PoolSite], load: RegionLoad) -> RoleChange | None:
    """A narrowed site back to both roles, at once, when for one of its models no other usable site in
    the region does the role it gave up (that site died, was cordoned or drained after the narrowing).
    The dwell and settle times hold back load-driven moves only: waiting them out here would leave the
    region's clients (a key allowed only this region) with nowhere to run that step."""
    for site in sorted(sites, key=lambda s: s.name):
        if not (site.usable and site.flexible and site.active_role in ("prefill", "decode")):
            continue
        gave_up = _other(site.active_role)
        others = [s for s in sites if s.usable and s is not site]
        for model in sorted(m for m in site.models if site.unnarrowed.serves(m, gave_up)):
            if not any(s.does_for(gave_up, model) for s in others):
                return RoleChange(site.name, region, BOTH, f"no other usable site in {region} does {gave_up} for "
                                                           f"{model}: back to both roles, before the dwell", load)
    return None


def _wanted_role(load: RegionLoad, settings: PlannerSettings) -> tuple[str | None, str]:
    prefill, decode = load.prefill_pressure, load.decode_pressure
    if prefill >= settings.high and decode < settings.high:
        return "prefill", f"prefill backlog {load.prefill_backlog_s:.2f}s is over target; decode is not"
    if decode >= settings.high and prefill < settings.high:
        return "decode", (f"decode pressure (inter-token {1000 * load.inter_token_s:.0f}ms, KV {100 * load.kv_used:.0f}% "
                          f"used) is over target; prefill is not")
    if prefill < settings.low and decode < settings.low:
        return BOTH, "prefill and decode are both well under target"
    return "hold", ""


def _other(role: str) -> str:
    return "decode" if role == "prefill" else "prefill"


def _role_covered(sites: list[PoolSite], leaving: PoolSite, role: str) -> bool:
    """Every model `leaving` does `role` for is still done by another live site in the region once
    it stops: a site serving another model does not cover for it."""
    others = [s for s in sites if s.usable and s is not leaving]
    return all(any(s.does_for(role, model) for s in others)
               for model in leaving.models if leaving.does_for(role, model))


def _preference(site: PoolSite, want: str | None) -> tuple:
    """Which flexible site moves: one doing only the other role first (it adds the most), then the
    least busy in the role it gives up (the least work to finish), then by name."""
    if want is BOTH:
        return (0, site.name)
    gives_up = _other(want)
    busy = site.capacity.get("num_running", 0) if gives_up == "decode" else site.capacity.get("inflight_prefill_tokens", 0)
    return (0 if site.active_role == gives_up else 1, busy, site.name)


@dataclass(slots=True)
class Planner:
    """Applies `plan` every tick while holding the planner lease."""

    store: RegistryStore
    read_snapshot: Callable[[], bytes]
    settings: PlannerSettings = field(default_factory=PlannerSettings)
    clock: Callable[[], float] = time.time
    holder: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}")
    # dry run: what it would have done, so it does not report the same change every tick
    _pretend: dict[str, tuple[str | None, float]] = field(default_factory=dict)
    num_changes: int = 0

    @property
    def lease_name(self) -> str:
        return DRY_RUN_LEASE_NAME if self.settings.dry_run else LEASE_NAME

    def tick(self) -> list[RoleChange]:
        """The role changes made this tick (in a dry run: the ones it would make)."""
        if not self.store.leases.acquire(self.lease_name, self.holder, ttl_s=3 * self.settings.interval_s):
            return []
        now = self.clock()
        snapshot = json.loads(self.read_snapshot())
        if self.settings.dry_run:
            _overlay(snapshot, self._pretend)
        made = []
        for change in plan(snapshot, now, self.settings):
            try:
                if self._apply(change, now):
                    made.append(change)
            except LeaseLost as exc:
                # Stalled past the lease: another planner may be acting on a newer snapshot by now.
                log.warning("planner: lost the planner lease before setting %s to %s, so nothing was changed "
                            "(%s); the holder of the lease plans from here", change.site, change.role or "both", exc)
                break
        return made

    def _apply(self, change: RoleChange, now: float) -> bool:
        """Makes the change, only while this planner holds the lease (LeaseLost otherwise); False when
        the store refused it."""
        role = change.role or "both"
        if self.settings.dry_run:
            self._pretend[change.site] = (change.role, now)
            log.info("planner (dry run): would set %s (%s) to %s: %s %s", change.site, change.region, role,
                     change.reason, change.load.figures())
            return True
        try:
            self.store.sites.set_active_role(change.site, change.role, ACTOR, change.detail(),
                                             lease=LeaseClaim(self.lease_name, self.holder))
        except LeaseLost:
            raise
        except RegistryStoreError as exc:  # the site changed or vanished since the snapshot: next tick sees it
            log.warning("planner: could not set %s to %s: %s", change.site, role, exc)
            return False
        self.num_changes += 1
        log.info("planner: %s (%s) now does %s: %s", change.site, change.region, role, change.reason)
        return True

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.to_thread(self.tick)
            except SQLAlchemyError as exc:  # the database is away: the next tick retries
                _db_errors.warning("database", "planner: no tick while the database is unreachable (%s)", exc)
            except Exception:  # a bug must not end planning for good; it is logged in full
                log.exception("planner tick failed")
            try:
                await asyncio.wait_for(stop.wait(), self.settings.interval_s)
            except TimeoutError:
                pass
        await asyncio.to_thread(self.store.leases.release, self.lease_name, self.holder)


def _overlay(snapshot: dict, pretend: dict[str, tuple[str | None, float]]) -> None:
    """The dry run's picks over the snapshot, each site's offer re-derived by the rule that published it."""
    for doc in snapshot.get("sites", ()):
        if doc["name"] in pretend:
            doc["active_role"], doc["active_role_since"] = pretend[doc["name"]]
            doc["role_offer"] = read_role_offer({**doc, "role_offer": None}).to_json()
