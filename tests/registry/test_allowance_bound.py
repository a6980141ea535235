"""The global rate limit's bound (registry/allowance.py), shown with simulated routers and a simulated
clock: real RateLimiters (router/rate_limit.py) report to the real registry store through a network
with delays, clients far beyond the limit, requests that give tokens back when they end, routers that
die, clocks that drift, and a registry that goes away. No sleeps: the clock moves from event to event.
The store runs on SQLite here (each report is one transaction, in turn); its SQL is the same on
PostgreSQL, where tests/registry/test_fleet_reports.py runs it.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

import pytest

from registry.allowance import GRANT_TTL_S, HOLD_S, PROVISIONAL_SPLIT, WINDOW_S, Held, allowance
from registry.fleet import FleetReport
from registry.records import ApiKeySpec
from router.rate_limit import Charge, RateLimiter, Refusal

REPORT_S = 1.0


@dataclass(slots=True)
class SimRouter:
    name: str
    limiter: RateLimiter
    rate_per_s: float                  # this router's clients' arrival rate (per key)
    alive: bool = True
    crash_after: int | None = None     # dies once it has admitted this many since its last report went out
    unreported: int = 0
    inflight: bool = False
    last_start: float = -1.0
    num_sent: int = 0


@dataclass(slots=True)
class Admission:
    at: float
    router: str
    key: str
    tokens: int                         # what the request used in the end


@dataclass
class Simulation:
    """Routers, their clients and the registry on one simulated clock."""

    store: object
    clock: object
    keys: dict[str, int]                                 # name -> key id
    limits: dict[str, tuple[int | None, int | None]]     # name -> (requests/min, tokens/min)
    seed: int = 0
    registry_down: tuple[float, float] | None = None     # [start, end) of an outage
    latency_s: float = 0.05                              # each way, at most (uniform from 1 ms)
    events: list = field(default_factory=list)
    routers: dict[str, SimRouter] = field(default_factory=dict)
    admitted: list[Admission] = field(default_factory=list)
    num_refused: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.start = self.clock.now
        self._order = itertools.count()

    def add_router(self, name: str, rate_per_s: float, skew_s: float = 0.0) -> None:
        clock = self.clock
        limiter = RateLimiter(clock=lambda: clock.now, wall=lambda: clock.now + skew_s)
        self.routers[name] = SimRouter(name, limiter, rate_per_s)
        self.at(self.rng.uniform(0, REPORT_S), "report", name)
        for key in self.keys:
            self.at(self.rng.expovariate(rate_per_s), "arrival", (name, key))

    def at(self, delay: float, kind: str, payload) -> None:
        heapq.heappush(self.events, (self.clock.now + delay, next(self._order), kind, payload))

    def run(self, seconds: float, crash: dict[str, tuple[float, int]] | None = None) -> None:
        """`crash`: router -> (when, n): from `when` on, it dies once it has admitted n unreported requests."""
        for name, when in (crash or {}).items():
            self.at(when[0], "crash", (name, when[1]))
        end = self.start + seconds
        while self.events and self.events[0][0] < end:
            when, _order, kind, payload = heapq.heappop(self.events)
            self.clock.now = when
            getattr(self, f"_on_{kind}")(payload)

    # -- events --------------------------------------------------------------------------------

    def _on_arrival(self, payload) -> None:
        name, key = payload
        router = self.routers[name]
        if not router.alive:
            return
        self.at(self.rng.expovariate(router.rate_per_s), "arrival", payload)
        rpm, tpm = self.limits[key]
        charged = self.rng.randint(20, 200)
        decision = router.limiter.admit(self.keys[key], rpm, tpm, charged)
        if isinstance(decision, Refusal):
            self.num_refused += 1
            if decision.ask:
                self._send_soon(router)
            return
        assert isinstance(decision, Charge)
        used = self.rng.randint(1, charged)
        self.admitted.append(Admission(self.clock.now, name, key, used))
        router.unreported += 1
        if router.crash_after is not None and router.unreported >= router.crash_after:
            router.alive = False   # kill -9: what it charged since its last report is never reported
        self.at(self.rng.uniform(0.2, 8.0), "finish", (name, decision, charged - used))

    def _on_finish(self, payload) -> None:
        name, charge, unused = payload
        if self.routers[name].alive:
            self.routers[name].limiter.give_back(charge, unused)

    def _on_report(self, name: str) -> None:
        router = self.routers[name]
        if router.alive:
            self.at(REPORT_S * self.rng.uniform(0.9, 1.1), "report", name)
            self._send_soon(router)

    def _send_soon(self, router: SimRouter) -> None:
        if router.inflight or self.clock.now - router.last_start < 0.05:
            return
        router.inflight, router.last_start, router.unreported = True, self.clock.now, 0
        part = router.limiter.take_report()
        report = FleetReport(router.name, part.seq, router.name, part.charges, [], part.demand)
        self.at(self._latency(), "apply", (router.name, report, self.clock.now))

    def _on_apply(self, payload) -> None:
        name, report, sent_at = payload
        if self.registry_down and self.registry_down[0] <= self.clock.now < self.registry_down[1]:
            self.at(self._latency(), "failed", (name, report))
            return
        answer = self.store.fleet.apply_report(report).to_json()
        self.at(self._latency(), "answer", (name, report, sent_at, answer))

    def _on_answer(self, payload) -> None:
        name, report, sent_at, answer = payload
        router = self.routers[name]
        if router.alive:
            router.inflight = False
            router.limiter.answered(report.seq, sent_at, answer)

    def _on_failed(self, payload) -> None:
        name, report = payload
        router = self.routers[name]
        if not router.alive:
            return
        router.limiter.failed()
        # The same report goes again after a backoff (the reporter keeps it until it is answered).
        self.at(self.rng.uniform(0.2, 0.5), "apply", (name, report, self.clock.now))

    def _latency(self) -> float:
        return self.rng.uniform(0.001, self.latency_s)

    def _on_crash(self, payload) -> None:
        name, num_unreported = payload
        self.routers[name].crash_after = num_unreported

    # -- what clients got ----------------------------------------------------------------------

    def worst_window(self, key: str, start: float = 0.0, end: float = float("inf")) -> tuple[int, int]:
        """The most requests and the most tokens the key was admitted in any 60 s window lying within
        [start, end) (seconds from the simulation's start)."""
        times = sorted((a.at - self.start, a.tokens) for a in self.admitted if a.key == key)
        most_requests = most_tokens = 0
        j, tokens = 0, 0
        for i, (t, used) in enumerate(times):   # the window (t − 60, t] ending at each admission
            tokens += used
            while times[j][0] <= t - WINDOW_S:
                tokens -= times[j][1]
                j += 1
            if t - WINDOW_S >= start and t < end:
                most_requests, most_tokens = max(most_requests, i - j + 1), max(most_tokens, tokens)
        return most_requests, most_tokens

    def admitted_between(self, key: str, start: float, end: float) -> int:
        return sum(1 for a in self.admitted if a.key == key and self.start + start <= a.at < self.start + end)


@pytest.fixture
def store(sqlite_store):
    return sqlite_store


@pytest.fixture
def keys(store):
    def make(**limits: tuple[int | None, int | None]) -> dict[str, int]:
        return {name: store.access.create_api_key(ApiKeySpec(name, requests_per_minute=rpm, tokens_per_minute=tpm),
                                                  "alice")[0].id for name, (rpm, tpm) in limits.items()}
    return make


LIMITS = {"rpm": (60, None), "tpm": (None, 6000), "both": (40, 3000)}


def over_limit_bound(limit: int | None) -> int:
    return 10**9 if limit is None else limit + limit // PROVISIONAL_SPLIT


def test_busy_routers_never_exceed_a_keys_limit_in_any_minute(store, clock, keys):
    # A slow registry (answers up to 0.3 s after a report left): routers keep admitting from what
    # they had left while their report is out, which the registry must keep holding.
    sim = Simulation(store, clock, keys(**LIMITS), LIMITS, seed=1, latency_s=0.15)
    for i, rate in enumerate((4.0, 1.0, 0.2)):   # uneven demand: grants must follow it
        sim.add_router(f"r{i}", rate)
    sim.run(185.0)
    for key, (rpm, tpm) in LIMITS.items():
        requests, tokens = sim.worst_window(key)
        # the bound registry.allowance documents: L, plus at most L / PROVISIONAL_SPLIT admitted by routers
        # that held no grant yet (a first request is not kept waiting for the registry)
        assert requests <= over_limit_bound(rpm) and tokens <= over_limit_bound(tpm), key
    # Not by refusing everything: the clients, far beyond the limit, get (nearly) all of it each minute.
    for minute in range(3):
        assert sim.admitted_between("rpm", 60 * minute, 60 * minute + 60) >= 60 * 0.9
    assert sim.num_refused > 1000


def test_a_dead_routers_unreported_charges_still_count(store, clock, keys):
    limits = {"rpm": (60, None)}
    sim = Simulation(store, clock, keys(**limits), limits, seed=3)
    sim.add_router("busy", 10.0)
    sim.add_router("doomed", 10.0)
    sim.run(190.0, crash={"doomed": (60.0, 3)})   # as the window turns, with 3 admissions not yet reported
    death = max(a.at for a in sim.admitted if a.router == "doomed") - sim.start
    assert sim.worst_window("rpm")[0] <= 60
    # Until the dead router's hold lapses (HOLD_S after its last report) the survivor gets the rest of
    # the window, then the whole of it again.
    assert sim.worst_window("rpm", start=death, end=death + HOLD_S)[0] < 60
    assert sim.worst_window("rpm", start=death)[0] >= 60 * 0.9


def test_a_clock_running_behind_adds_at_most_its_own_lag(store, clock, keys):
    limits = {"rpm": (60, None)}
    sim = Simulation(store, clock, keys(**limits), limits, seed=4)
    sim.add_router("exact", 5.0)
    sim.add_router("late", 5.0, skew_s=-2.0)   # its slots leave the window 2 s early
    sim.run(190.0)
    late = sorted(a.at for a in sim.admitted if a.router == "late")
    lag_admissions = max(sum(1 for t in late if s <= t < s + 2.0) for s in late)
    assert sim.worst_window("rpm")[0] <= 60 + lag_admissions


def test_without_the_registry_each_router_holds_its_share_of_the_limit(store, clock, keys):
    limits = {"rpm": (60, None)}
    sim = Simulation(store, clock, keys(**limits), limits, seed=5, registry_down=(clock.now + 70, clock.now + 200))
    for i in range(3):
        sim.add_router(f"r{i}", 5.0)
    sim.run(260.0)
    assert all(r.limiter.live_routers == 3 for r in sim.routers.values())
    # A window wholly inside the outage, once the grants from before it lapsed: each router admits
    # its own L / 3 ...
    inside = sim.worst_window("rpm", start=70 + GRANT_TTL_S, end=200)[0]
    assert 50 <= inside <= 60
    # ... across the switch, less than 2L; and back under the registry's grants, the bound again.
    assert sim.worst_window("rpm")[0] < 120
    assert sim.worst_window("rpm", start=200)[0] <= 60
    assert all(r.limiter.num_local_admissions > 0 for r in sim.routers.values())


def test_grant_arithmetic():
    # At most twice the router's demand; alone, up to the whole free window.
    assert (allowance(60, 0, 3, 0, []).grant, allowance(60, 0, 3, 0, []).unallocated) == (6, 54)
    assert allowance(60, 0, 40, 0, []).grant == 60
    # Busy neighbours: a share by demand, never more than nobody holds.
    split = allowance(60, 20, demand=10, remaining=0, others=[Held(10, 30)])
    assert (split.grant, split.hold, split.free, split.unallocated) == (10, 10, 40, 20)
    assert allowance(60, 20, demand=30, remaining=0, others=[Held(35, 10)]).grant == 5   # b holds more than its share
    assert allowance(60, 70, demand=30, remaining=0, others=[]).grant == 0              # window over-full
    # What it may still spend of its last grant stays held even when the new grant is smaller.
    held = allowance(60, 50, demand=10, remaining=8, others=[])
    assert (held.grant, held.hold, held.unallocated) == (10, 10, 0)
    held = allowance(60, 55, demand=10, remaining=8, others=[])
    assert (held.grant, held.hold, held.unallocated) == (5, 8, 0)
    assert allowance(60, 0, 0, 0, [Held(0, 0)]).grant == 0   # no demand, no grant
