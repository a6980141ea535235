"""The registry goes away: the router keeps serving from its last good view, checks its sites
directly once that view is older than snapshot_max_age_s, and stays healthy; its own broken feed
makes it unhealthy (router/snapshot_feed.py)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from router_fake_agent import MODEL

from registry.client import RegistryClient
from router import snapshot_feed
from router.config import RouterConfig
from router.server import Router

ROUTER_TOKEN = "router-secret"  # as the cluster fixture's registry is configured
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class SwitchableTransport(httpx.AsyncBaseTransport):
    """The registry's ASGI transport, switchable to unreachable, or to a freshly restarted registry
    whose sites have not heartbeated yet (every site dead in its snapshot)."""

    def __init__(self, app) -> None:
        self.inner = httpx.ASGITransport(app)
        self.down = False
        self.sites_dead = False

    async def handle_async_request(self, request):
        if self.down:
            raise httpx.ConnectError("registry unreachable", request=request)
        if not self.sites_dead or request.url.path != "/v1/router/snapshot":
            return await self.inner.handle_async_request(request)
        del request.headers["if-none-match"]  # the restarted registry's snapshot has a new version
        response = await self.inner.handle_async_request(request)
        document = json.loads(await response.aread())
        for site in document["sites"]:
            site["alive"], site["heartbeat_age_s"] = False, 90.0
        headers = {"content-type": "application/json", "etag": '"restarted"'}
        return httpx.Response(200, headers=headers, content=json.dumps(document).encode())


@pytest.fixture
async def outage_router(cluster):
    """(router, url, transport, headers): a router on a switchable registry, short max age and check interval."""
    routers = []

    async def make(**settings):
        key = await cluster.create_key()
        transport = SwitchableTransport(cluster.app)
        config = RouterConfig(**{"host": "127.0.0.1", "port": 0, "lat": 50.1, "lon": 8.7, "snapshot_refresh_s": 0.1,
                                 "snapshot_max_age_s": 0.5, "site_check_interval_s": 0.1,
                                 "first_token_timeout_s": 2.0, "token_idle_timeout_s": 2.0, **settings})
        router = Router(config, registry=RegistryClient("http://registry", ROUTER_TOKEN, transport=transport))
        await router.start()
        routers.append(router)
        return router, await router.start_server(), transport, {"Authorization": f"Bearer {key}"}

    yield make
    for router in routers:
        await router.stop()


async def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def served(http, url: str, headers: dict, count: int = 3) -> None:
    for _ in range(count):
        response = await http.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers)
        assert response.status_code == 200, response.text


async def test_registry_down_past_max_age_serves_checked_sites_and_drops_a_dead_one(cluster, http, outage_router):
    fra = await cluster.add_site("fra", 50.1, 8.7)
    ams = await cluster.add_site("ams", 52.4, 4.9)
    router, url, transport, headers = await outage_router()
    await served(http, url, headers, 1)
    transport.down = True
    await served(http, url, headers)  # within max age: the last good snapshot as it is
    await wait_until(lambda: router.feed.status().view == "checked")
    health = await http.get(f"{url}/healthz")
    assert health.status_code == 200, health.text
    body = health.json()
    assert body.pop("rate_limits")["mode"] == "global"   # this key has no limit: nothing held locally
    assert body | {"snapshot_age_s": 0} == {
        "ok": True, "registry": "unreachable", "view": "checked", "live_sites": 2, "snapshot_age_s": 0,
        "num_refresh_errors": body["num_refresh_errors"], "last_error": body["last_error"]}
    await served(http, url, headers)
    assert fra.num_health_checks and ams.num_health_checks

    # The agents' own load figures replace the snapshot's: fra says it is full, so ams serves.
    fra.health_load = {"kv_blocks_total": 1000, "kv_blocks_free": 0}
    fra_checks = fra.num_health_checks
    await wait_until(lambda: fra.num_health_checks >= fra_checks + 2)
    fra_calls = len(fra.calls)
    await served(http, url, headers)
    assert len(fra.calls) == fra_calls

    # A site that dies during the outage is dropped; every request is still served.
    fra.health_load = {"kv_blocks_total": 1000, "kv_blocks_free": 1000}
    await fra.stop()
    await wait_until(lambda: router.feed.status().live_sites == 1)
    await served(http, url, headers)
    # An unknown key cannot be checked while the registry is down: 503, not 401.
    unknown = await http.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer x"})
    assert unknown.status_code == 503 and "retry-after" in unknown.headers

    assert router.fleet.status()["reports_failing"]
    transport.down = False
    await wait_until(lambda: router.feed.status().view == "registry")
    assert (await http.get(f"{url}/healthz")).json()["registry"] == "ok"
    # What was served during the outage reaches the registry's usage once it is back: 13 requests.
    await wait_until(lambda: router.fleet.status()["num_reports"] > 0 and not router.fleet.status()["reports_failing"])
    await router.fleet.stop()
    assert (await cluster.admin.usage(granularity="total"))["totals"]["requests"] == 13


async def test_registry_back_without_live_sites_keeps_the_last_good_view(cluster, http, outage_router):
    await cluster.add_site("fra", 50.1, 8.7)
    router, url, transport, headers = await outage_router(snapshot_max_age_s=30.0)
    transport.down = True
    await wait_until(lambda: router.feed.status().registry == "unreachable")
    transport.down, transport.sites_dead = False, True  # back, before any heartbeat reached it
    await wait_until(lambda: router.feed.status().registry == "warming_up")
    await served(http, url, headers)
    health = await http.get(f"{url}/healthz")
    assert health.status_code == 200 and health.json()["view"] == "last_good", health.text
    transport.sites_dead = False  # heartbeats are back: the registry's view has live sites again
    await wait_until(lambda: router.feed.status().registry == "ok")
    await served(http, url, headers, 1)


async def test_a_broken_feed_never_stops_and_makes_healthz_unhealthy(cluster, http, outage_router, monkeypatch):
    await cluster.add_site("fra", 50.1, 8.7)
    router, url, _transport, headers = await outage_router()

    def cannot_parse(_document):
        raise ValueError("a snapshot this router cannot read")

    monkeypatch.setattr(snapshot_feed, "parse_snapshot", cannot_parse)
    await cluster.heartbeat("fra")  # a new registry version: the router fetches (and fails on) a full document
    await wait_until(lambda: not router.feed.status().healthy)
    health = await http.get(f"{url}/healthz")
    assert health.status_code == 503, health.text
    assert "feed fails" in health.json()["reason"] and "cannot read" in health.json()["last_error"]
    assert health.json()["registry"] == "feed_error" and health.json()["num_refresh_errors"] >= 2
    await served(http, url, headers)  # still serving: the sites it knows pass their checks

    refresh_task = router.feed._tasks["snapshot-refresh"]
    refresh_task.cancel()  # even a task ended from outside comes back
    await wait_until(lambda: router.feed._tasks["snapshot-refresh"] is not refresh_task
                     and not router.feed._tasks["snapshot-refresh"].done())

    monkeypatch.undo()
    assert await router.feed.refresh()
    health = await http.get(f"{url}/healthz")
    assert health.status_code == 200 and health.json()["registry"] == "ok", health.text


async def test_a_router_that_never_reached_the_registry_is_unhealthy(cluster, http, outage_router):
    router, url, transport, _headers = await outage_router()
    transport.down = True
    router.feed._good = None  # as if it had started during the outage
    health = await http.get(f"{url}/healthz")
    assert health.status_code == 503 and "no site list" in health.json()["reason"]
