"""The router's in-memory tables after hours of traffic: what a request leaves behind is dropped once it can
no longer matter, so a router that runs for days holds what its last minutes need, not all it ever saw."""

from __future__ import annotations

import httpx
import pytest

from registry.allowance import MAX_FUTURE_SLOTS, WINDOW_S, WINDOW_SLOTS
from router.api_keys import NEGATIVE_TTL_S, ApiKeyCache
from router.errors import ApiError
from router.fleet_reporter import FleetReporter, UsageMeter
from router.rate_limit import Charge, RateLimiter
from router.sessions import SessionTable, session_key

RECORD = {"id": 7, "name": "team", "allowed_regions": [], "requests_per_minute": None, "tokens_per_minute": None}


def _grant(key_id: int, requests: int) -> dict:
    return {"grants": [{"key_id": key_id, "requests": {"grant": requests, "unallocated": 0, "free": requests,
                                                        "reset_s": 0.0}, "tokens": None}], "live_routers": 1}


def _report(limiter: RateLimiter, now: float, requests: int = 100) -> None:
    """One report and the registry's answer, granting key 7 `requests`."""
    part = limiter.take_report()
    limiter.answered(part.seq, now, _grant(7, requests))


def _granted_limiter(now: list[float], requests_per_minute: int) -> RateLimiter:
    """A limiter whose key 7 has asked for and got its first grant."""
    limiter = RateLimiter(clock=lambda: now[0], wall=lambda: now[0])
    assert limiter.admit(7, requests_per_minute, None, 1).ask
    _report(limiter, now[0])
    return limiter


def test_a_key_in_use_all_day_keeps_only_a_window_of_its_charges():
    now = [1_000_000.0]
    limiter = _granted_limiter(now, 1000)
    for _ in range(3 * 3600):   # three hours of one request a second, one report a second
        assert isinstance(limiter.admit(7, 1000, None, 10), Charge)
        _report(limiter, now[0])
        now[0] += 1.0
    assert len(limiter._history[7]) <= WINDOW_S + 2


def test_the_local_share_still_counts_the_whole_window_after_pruning():
    now = [1_000_000.0]
    limiter = _granted_limiter(now, 90)
    for _ in range(120):   # 2 minutes at one request a second against a limit of 90 a minute
        assert isinstance(limiter.admit(7, 90, None, 1), Charge)
        _report(limiter, now[0])
        now[0] += 1.0
    limiter.failed()
    now[0] += 30.0          # no answer for a grant's life: the local share (90 / 1 router) from its own window
    admitted = sum(isinstance(limiter.admit(7, 90, None, 1), Charge) for _ in range(100))
    assert admitted == 90 - 30   # the charges of the last 30 of those 120 seconds are still in the window


async def test_made_up_api_keys_do_not_pile_up_in_the_key_cache():
    now = [0.0]

    registry_up = [True]

    async def lookup(secret: str) -> dict | None:
        if not registry_up[0]:
            raise httpx.ConnectError("registry down")
        return RECORD if secret == "ef-real" else None

    cache = ApiKeyCache(lookup, ttl_s=30.0, clock=lambda: now[0])
    assert (await cache.authenticate("ef-real")).id == 7
    for i in range(5000):   # a client trying a new key on every request, 100 a second
        with pytest.raises(ApiError) as refused:
            await cache.authenticate(f"ef-guess-{i}")
        assert refused.value.status == 401
        now[0] += 0.01
    assert len(cache) <= 1 + 2 * NEGATIVE_TTL_S / 0.01 + 1
    now[0] += 1000.0
    registry_up[0] = False  # the registry is away: the real key is served on its last answer
    assert (await cache.authenticate("ef-real")).id == 7


async def test_the_key_cache_holds_at_most_its_cap_the_newest_kept():
    lookups: list[str] = []

    async def lookup(secret: str) -> dict | None:
        lookups.append(secret)
        return {**RECORD, "id": int(secret.rpartition("-")[2])}

    cache = ApiKeyCache(lookup, ttl_s=30.0, clock=lambda: 0.0, max_entries=100)
    for i in range(1000):
        assert (await cache.authenticate(f"ef-key-{i}")).id == i
    assert len(cache) == 100
    lookups.clear()
    assert (await cache.authenticate("ef-key-999")).id == 999
    assert lookups == []    # still cached: the oldest went first


def test_idle_sessions_leave_the_table_without_waiting_for_the_cap():
    now = [0.0]
    table = SessionTable(max_sessions=100_000, ttl_s=1800.0, clock=lambda: now[0])
    for i in range(5000):
        table.remember(session_key(3, f"sess-{i}", None), "lisbon", "frankfurt")
    now[0] += 1801.0
    table.remember(session_key(3, "sess-new", None), "warsaw", "warsaw")
    assert len(table) == 1
    assert table.pair(session_key(3, "sess-new", None)) == ("warsaw", "warsaw")


def test_a_session_in_use_stays_while_idle_ones_go():
    now = [0.0]
    table = SessionTable(max_sessions=100, ttl_s=60.0, clock=lambda: now[0])
    table.remember("old", "p", "d")
    table.remember("busy", "p", "p")
    now[0] = 50.0
    table.remember("busy", "q", "q")
    now[0] = 100.0
    table.remember("new", "p", "p")
    assert len(table) == 2
    assert table.pair("busy") == ("q", "q") and table.pair("old") is None


async def test_an_hour_without_the_registry_keeps_a_window_of_charges_not_the_hour():
    now = [1_000_000.0]

    async def unreachable(_body: dict) -> dict:
        raise httpx.ConnectError("registry down")

    limiter = _granted_limiter(now, 100_000)
    reporter = FleetReporter(unreachable, limiter, UsageMeter(wall=lambda: now[0]), clock=lambda: now[0])
    for second in range(3600):   # the router keeps serving from its local share, one request a second
        assert isinstance(limiter.admit(7, 100_000, None, 10), Charge)
        if second % 2 == 0:      # the reporter tries again every couple of seconds (its backoff's cap)
            assert not await reporter.report_once()
        now[0] += 1.0
    assert limiter.local_share
    assert len(limiter._pending) <= WINDOW_SLOTS + MAX_FUTURE_SLOTS + 2
    assert sum(len(slots) for slots in limiter._history.values()) <= WINDOW_S + 2
