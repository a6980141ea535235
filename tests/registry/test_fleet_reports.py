"""Routers' reports to the registry: usage accounting per key, model and hour (applied once, however
often a report is resent, to whichever replica), grants of the global rate limits, and the admin view."""

from __future__ import annotations

import httpx
import pytest

from registry.client import RegistryClient, RegistryError
from registry.fleet import FleetReport, KeyDemand, RateCharge, UsageCount, UsageQuery
from registry.records import ApiKeySpec
from registry.service import create_app

from .conftest import ADMIN_TOKEN, ROUTER_TOKEN

HOUR = 3600


def usage_count(key_id: int, hour: int, model: str = "tiny", requests: int = 1, prompt: int = 10, cached: int = 4,
                completion: int = 5) -> dict:
    return {"key_id": key_id, "model": model, "hour": hour, "requests": requests, "prompt_tokens": prompt,
            "cached_prompt_tokens": cached, "completion_tokens": completion}


async def test_usage_reports_add_up_once_each_and_read_back_by_hour_day_and_total(admin, router_client, clock):
    key = await admin.create_api_key("team-a")
    other = await admin.create_api_key("team-b")
    day = int(clock.now) // 86400 * 86400
    first = {"router_id": "r-1", "name": "router-1", "seq": 1,
             "usage": [usage_count(key["id"], day), usage_count(key["id"], day + HOUR, requests=2, completion=7),
                       usage_count(other["id"], day, model="big", prompt=100, cached=0, completion=1)]}
    assert (await router_client.fleet_report(first))["applied"] is True
    assert (await router_client.fleet_report(first))["applied"] is False   # the answer was lost; resent
    await router_client.fleet_report({"router_id": "r-2", "seq": 1, "usage": [usage_count(key["id"], day)]})
    await router_client.fleet_report({"router_id": "r-1", "seq": 2, "usage": [usage_count(key["id"], day + 86400)]})

    hourly = await admin.usage(key_id=key["id"])
    assert [(r["period_start"], r["requests"], r["prompt_tokens"], r["cached_prompt_tokens"], r["completion_tokens"],
             r["total_tokens"]) for r in hourly["items"]] == [
        (day, 2, 20, 8, 10, 30), (day + HOUR, 2, 10, 4, 7, 17), (day + 86400, 1, 10, 4, 5, 15)]
    assert hourly["items"][0]["key_name"] == "team-a"
    daily = await admin.usage(key_id=key["id"], granularity="day")
    assert [(r["period_start"], r["requests"]) for r in daily["items"]] == [(day, 4), (day + 86400, 1)]
    total = await admin.usage(granularity="total")
    assert [(r["key_id"], r["model"], r["period_start"], r["requests"]) for r in total["items"]] == [
        (key["id"], "tiny", None, 5), (other["id"], "big", None, 1)]
    assert total["totals"]["requests"] == 6 and total["totals"]["prompt_tokens"] == 140
    window = await admin.usage(start=day + HOUR, end=day + 2 * HOUR)
    assert [(r["period_start"], r["requests"]) for r in window["items"]] == [(day + HOUR, 2)]
    iso = await admin.usage(model="big", start="1970-01-01T00:00:00Z")
    assert [r["model"] for r in iso["items"]] == ["big"]
    routers = (await admin.routers())["items"]
    assert [(r["router_id"], r["name"], r["last_seq"], r["live"]) for r in routers] == [
        ("r-1", "router-1", 2, True), ("r-2", "", 1, True)]


async def test_bad_usage_queries_and_reports_say_what_to_change(admin, router_client, clock):
    with pytest.raises(RegistryError, match="granularity: must be one of hour, day, total"):
        await admin.usage(granularity="week")
    with pytest.raises(RegistryError, match="from: 'yesterday' is neither epoch seconds nor an ISO 8601 time"):
        await admin.usage(start="yesterday")
    with pytest.raises(RegistryError, match="to must be later than from"):
        await admin.usage(start=100, end=100)
    for bad in ("inf", "nan", "-5", "1e300"):
        with pytest.raises(RegistryError, match="out of range"):
            await admin.usage(end=bad)
    with pytest.raises(RegistryError, match="model: must be text without control characters"):
        await admin.usage(model="ti\x00ny")
    key = await admin.create_api_key("team-a")
    with pytest.raises(RegistryError, match="not the start of an hour") as error:
        await router_client.fleet_report({"router_id": "r-1", "seq": 1, "usage": [usage_count(key["id"], 1234)]})
    assert error.value.status == 422
    with pytest.raises(RegistryError, match="seq") as error:
        await router_client.fleet_report({"router_id": "r-1", "seq": 0})
    assert error.value.status == 422
    with pytest.raises(RegistryError, match="router_id"):
        await router_client.fleet_report({"router_id": "no spaces", "seq": 1})
    with pytest.raises(RegistryError) as error:   # an admin token is not a router's
        await admin.fleet_report({"router_id": "r-1", "seq": 1})
    assert error.value.status in (401, 403)


async def test_unknown_keys_are_dropped_not_fatal(admin, router_client, clock):
    key = await admin.create_api_key("team-a")
    hour = int(clock.now) // HOUR * HOUR
    answer = await router_client.fleet_report({
        "router_id": "r-1", "seq": 1, "usage": [usage_count(key["id"], hour), usage_count(999, hour)],
        "demand": [{"key_id": 999, "requests": 1}]})
    assert answer["grants"] == [{"key_id": 999, "known": False, "requests": None, "tokens": None}]
    assert (await admin.usage(granularity="total"))["totals"]["requests"] == 1


def test_grants_follow_demand_and_hold_what_a_router_may_still_spend(store, clock):
    key, _ = store.access.create_api_key(ApiKeySpec("k", requests_per_minute=60, tokens_per_minute=None), "alice")
    slot = int(clock.now)

    def report(router: str, seq: int, demand: float, remaining: int = 0, charged: int = 0):
        charges = [RateCharge(key.id, slot, charged, 0)] if charged else []
        result = store.fleet.apply_report(FleetReport(router, seq, charges=charges, demand=[
            KeyDemand(key.id, requests=demand, remaining_requests=remaining)]))
        (grant,) = result.grants
        assert grant.tokens is None   # no token limit: nothing to grant
        return grant.requests

    # twice its demand (10), or the floor: the unheld window (60) split over twice the live routers (1)
    assert report("a", 1, demand=5).grant == 30
    alone = report("a", 2, demand=40)
    assert (alone.grant, alone.unallocated) == (60, 0)   # the only router asking may get the whole window
    # b asks while a holds everything: nothing for b until a reports again.
    assert report("b", 1, demand=40).grant == 0
    # a spent 10, had 50 left when it reported; demand is even now: a's share is half of the 50 free.
    assert report("a", 3, demand=40, remaining=50, charged=10).grant == 25
    # a still holds 50 (what it may spend until its answer arrived), so b gets nothing yet ...
    assert report("b", 2, demand=40).grant == 0
    assert report("a", 4, demand=40, remaining=25).grant == 25
    again = report("b", 3, demand=40)   # ... and its half once a holds only its own share
    assert (again.grant, again.unallocated) == (25, 0)
    # a resent report changes no window, but is answered with fresh grants.
    assert report("b", 3, demand=40).grant == 25
    clock.advance(61)   # a's charge of 10 leaves the window; a has not reported for a minute
    later = report("b", 4, demand=40)
    assert (later.grant, later.reset_s) == (35, 0.0)   # a's hold still counts: it may have spent it unreported
    clock.advance(4)    # past HOLD_S since a's last report: its hold lapses
    assert report("b", 5, demand=40).grant == 60


async def test_a_report_resent_to_another_replica_is_applied_once(db_url, store, clock):
    key, _ = store.access.create_api_key(ApiKeySpec("k"), "alice")
    hour = int(clock.now) // HOUR * HOUR
    apps = [create_app(db_url, ADMIN_TOKEN, ROUTER_TOKEN, store=store) for _ in range(2)]
    body = {"router_id": "r-1", "seq": 7, "usage": [usage_count(key.id, hour, requests=3)]}
    answers = []
    for app in apps:
        async with app.router.lifespan_context(app):
            async with RegistryClient("http://registry", ROUTER_TOKEN, transport=httpx.ASGITransport(app)) as router:
                answers.append((await router.fleet_report(body))["applied"])
    assert answers == [True, False]
    assert [r.requests for r in store.fleet.usage(UsageQuery(granularity="total"))] == [3]
    assert store.fleet.apply_report(FleetReport("r-1", 6, usage=[UsageCount(key.id, "tiny", hour, 5)])).applied is False
