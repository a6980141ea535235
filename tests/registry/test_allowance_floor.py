"""A key used far below its limit is never refused: every grant is at least a floor, a share of the
key's unheld room split over the live routers (registry/allowance.py), so a burst on a key that was
barely used, or idle for a few seconds, is admitted at once, without a round trip to the registry.
Real RateLimiters (router/rate_limit.py) report to the real registry store on one settable clock.
"""

from __future__ import annotations

import random

import pytest

from registry.allowance import Held, allowance
from registry.fleet import FleetReport
from registry.records import ApiKeySpec
from router.rate_limit import Charge, RateLimiter, Refusal

TEN_MILLION = 10_000_000


@pytest.fixture
def store(sqlite_store):
    return sqlite_store


class Router:
    """One router's limiter and its reports, answered at once by the store."""

    def __init__(self, name: str, store, clock) -> None:
        self.name, self.store, self.clock = name, store, clock
        self.limiter = RateLimiter(clock=clock, wall=clock)

    def report(self) -> None:
        sent_at = self.clock.now
        part = self.limiter.take_report()
        result = self.store.fleet.apply_report(FleetReport(self.name, part.seq, self.name, part.charges, [],
                                                           part.demand))
        self.limiter.answered(part.seq, sent_at, result.to_json())

    def admit(self, key_id: int, num_tokens: int) -> Charge | Refusal | None:
        decision = self.limiter.admit(key_id, None, TEN_MILLION, num_tokens)
        if isinstance(decision, Refusal) and decision.ask:   # what the reporter does: one early report
            self.report()
            decision = self.limiter.admit(key_id, None, TEN_MILLION, num_tokens, retry=True)
        return decision


def _key(store, name: str = "team-a") -> int:
    return store.access.create_api_key(ApiKeySpec(name, tokens_per_minute=TEN_MILLION), "alice")[0].id


def _trickle(routers: list[Router], key_id: int, clock, seconds: int) -> None:
    """Each router serves the key one small request a second and reports."""
    for _ in range(seconds):
        for router in routers:
            assert isinstance(router.admit(key_id, 500), Charge)
            router.report()
        clock.advance(1.0)


def test_a_burst_on_a_barely_used_key_is_admitted_without_asking_the_registry(store, clock):
    key_id = _key(store)
    routers = [Router("r1", store, clock), Router("r2", store, clock)]
    _trickle(routers, key_id, clock, seconds=5)
    # 200 requests of 5,000 tokens within one report interval: 10% of the key's minute, whose window
    # holds 5,000 tokens. Each must fit the grant this router already has: no report in between.
    burst = [routers[0].limiter.admit(key_id, None, TEN_MILLION, 5000) for _ in range(200)]
    assert [d for d in burst if not isinstance(d, Charge)] == []


def test_a_key_idle_for_a_few_seconds_is_admitted_at_once(store, clock):
    key_id = _key(store)
    router = Router("r1", store, clock)
    _trickle([router], key_id, clock, seconds=3)
    for _ in range(4):   # reports with no request for the key in them (it is kept for IDLE_RELEASE_S)
        router.report()
        clock.advance(1.0)
    assert isinstance(router.limiter.admit(key_id, None, TEN_MILLION, 20_000), Charge)


def test_a_large_request_after_small_ones_on_a_new_router_is_admitted(store, clock):
    key_id = _key(store)
    router = Router("new", store, clock)
    assert isinstance(router.admit(key_id, 100), Charge)       # its first: asks once, as before
    assert isinstance(router.limiter.admit(key_id, None, TEN_MILLION, 100_000), Charge)


def test_floors_never_hand_out_more_than_the_window_has_room_for():
    rng = random.Random(7)
    for _ in range(5000):
        limit = rng.choice((5, 60, 1000, TEN_MILLION))
        used = rng.randint(0, limit + 10)
        others = [Held(rng.randint(0, limit // 2), rng.uniform(0, limit)) for _ in range(rng.randint(0, 4))]
        result = allowance(limit, used, rng.uniform(0, limit / 10), rng.randint(0, limit // 4), others,
                           live_routers=len(others) + rng.randint(1, 3))
        room = limit - used - sum(o.hold for o in others)
        assert result.grant <= max(0, room)           # (I): used + Σ holds ≤ L
        assert result.grant >= 0 and result.unallocated >= 0


def test_floors_of_every_live_router_leave_half_the_room_for_demand():
    # Ten idle routers, each reporting in turn until their holds settle: together they hold at most half.
    holds = [0] * 10
    for _ in range(20):
        for i in range(10):
            others = [Held(h, 0.0) for j, h in enumerate(holds) if j != i]
            holds[i] = allowance(TEN_MILLION, 0, 0.0, 0, others, live_routers=10).hold
    assert 0 < sum(holds) <= TEN_MILLION // 2
    # At the limit, nothing: the floor is a share of the room left.
    assert allowance(60, 60, 0.0, 0, [], live_routers=1).grant == 0
    assert allowance(60, 40, 0.0, 0, [Held(20, 0.0)], live_routers=2).grant == 0
