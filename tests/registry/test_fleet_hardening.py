"""A router's reports after a long registry outage: what it served meanwhile reaches `key_usage` whole.

The router (router/rate_limit.py, router/fleet_reporter.py) talks to the real registry service here,
both on one settable clock, so an outage of many minutes takes no time."""

from __future__ import annotations

import httpx

from registry.client import RegistryClient
from registry.fleet import UsageQuery
from registry.records import ApiKeySpec
from registry.service import create_app
from router import fleet_reporter, rate_limit
from router.fleet_reporter import FleetReporter, UsageMeter
from router.rate_limit import RateLimiter

from .conftest import ROUTER_TOKEN

ADMIN = "admin-secret"


async def _serve_through_outage(db_url, store, clock, num_keys: int, outage_s: int) -> tuple[int, list[dict]]:
    """A router serves each key once a second through an outage of `outage_s`, then the registry answers
    again; returns the requests served and the statuses of the reports sent afterwards."""
    keys = [store.access.create_api_key(ApiKeySpec(f"k{i}", requests_per_minute=10**6), "alice")[0].id
            for i in range(num_keys)]
    app = create_app(db_url, ADMIN, ROUTER_TOKEN, store=store)   # the production body limit (1 MiB)
    outcomes: list[dict] = []
    async with app.router.lifespan_context(app):
        async with RegistryClient("http://registry", ROUTER_TOKEN, transport=httpx.ASGITransport(app)) as registry:
            up = False

            async def send(body: dict) -> dict:
                if not up:
                    raise httpx.ConnectError("the registry is down")
                try:
                    answer = await registry.fleet_report(body)
                except Exception as exc:
                    outcomes.append({"seq": body["seq"], "error": str(exc)})
                    raise
                outcomes.append({"seq": body["seq"], "charges": len(body["charges"])})
                return answer

            limiter = RateLimiter(clock=clock, wall=clock)
            meter = UsageMeter(wall=clock)
            reporter = FleetReporter(send, limiter, meter, name="r", clock=clock)
            assert await reporter.report_once() is False   # the registry is down: the local share admits
            served = 0
            for _ in range(outage_s):
                for key_id in keys:
                    charge = limiter.admit(key_id, 10**6, None, 0)
                    assert isinstance(charge, rate_limit.Charge)
                    meter.record(key_id, "tiny", 7, 0, 3)
                    served += 1
                clock.advance(1.0)
            up = True
            for _ in range(4):   # the report in flight, then what piled up
                await reporter.report_once()
                clock.advance(1.0)
    return served, outcomes


async def test_usage_served_through_a_long_outage_is_accepted_when_the_registry_returns(db_url, store, clock):
    # 10 keys for 20 minutes: 12,000 charges waited, more than a report may carry (10,000 per list).
    served, outcomes = await _serve_through_outage(db_url, store, clock, num_keys=10, outage_s=1200)
    assert [o for o in outcomes if "error" in o] == []
    totals = store.fleet.usage(UsageQuery(granularity="total"))
    assert sum(r.requests for r in totals) == served
    assert sum(r.prompt_tokens for r in totals) == 7 * served
    assert sum(r.completion_tokens for r in totals) == 3 * served


async def test_charges_of_many_keys_go_out_over_several_reports(db_url, store, clock, monkeypatch):
    monkeypatch.setattr(rate_limit, "MAX_REPORT_CHARGES", 50)
    monkeypatch.setattr(fleet_reporter, "MAX_REPORT_USAGE", 4)
    served, outcomes = await _serve_through_outage(db_url, store, clock, num_keys=9, outage_s=10)
    assert [o for o in outcomes if "error" in o] == []
    assert [o["charges"] for o in outcomes] == [0, 50, 40, 0]   # 90 charges: the newest 50 first
    assert sum(r.requests for r in store.fleet.usage(UsageQuery(granularity="total"))) == served == 90


async def test_an_api_key_posted_with_curls_default_content_type_is_a_415_saying_what_to_send(raw, admin):
    # `curl -d '{...}'` without -H says application/x-www-form-urlencoded: FastAPI never parses it as JSON.
    headers = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/x-www-form-urlencoded"}
    response = await raw.post("/v1/admin/api-keys", headers=headers, content=b'{"name": "team-a"}')
    assert response.status_code == 415
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "unsupported_media_type")
    assert "Content-Type: application/json" in error["message"] and "x-www-form-urlencoded" in error["message"]
    assert (await admin.list_api_keys())["items"] == []   # nothing was stored
    # Credentials are still checked first, and a JSON body with a bad field is still the 422 naming it.
    refused = await raw.post("/v1/admin/api-keys", headers={**headers, "Authorization": "Bearer nope"},
                             content=b'{"name": "team-a"}')
    assert refused.status_code == 401
    bad = await raw.post("/v1/admin/api-keys", headers={**headers, "Content-Type": "application/json"},
                         content=b'{"name": "team-a", "requests_per_minute": "5"}')
    assert bad.status_code == 422 and "requests_per_minute" in bad.json()["error"]["message"]
    made = await raw.post("/v1/admin/api-keys", headers={**headers, "Content-Type": "application/json; charset=utf-8"},
                          content=b'{"name": "team-a", "requests_per_minute": 5}')
    assert made.status_code == 201 and made.json()["requests_per_minute"] == 5
