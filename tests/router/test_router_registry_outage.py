"""Last-known-good snapshot while the registry is down, then fail-open or fail-closed."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from router_fake_agent import MODEL

from registry.client import RegistryClient
from router.config import RouterConfig
from router.server import Router

ROUTER_TOKEN = "router-secret"  # as the cluster fixture's registry is configured
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class SwitchableTransport(httpx.AsyncBaseTransport):
    """The registry's ASGI transport with a switch that makes it unreachable."""

    def __init__(self, app) -> None:
        self.inner = httpx.ASGITransport(app)
        self.down = False

    async def handle_async_request(self, request):
        if self.down:
            raise httpx.ConnectError("registry unreachable", request=request)
        return await self.inner.handle_async_request(request)


@pytest.mark.parametrize("fail_open", [False, True])
async def test_stale_snapshot_served_then_fail_mode_applies(cluster, http, fail_open):
    await cluster.add_site("fra", 50.1, 8.7)
    key = await cluster.create_key()
    transport = SwitchableTransport(cluster.app)
    config = RouterConfig(host="127.0.0.1", port=0, snapshot_refresh_s=0.1, snapshot_max_age_s=0.6,
                          snapshot_fail_open=fail_open)
    async with Router(config, registry=RegistryClient("http://registry", ROUTER_TOKEN, transport=transport)) as router:
        url = await router.start_server()
        headers = {"Authorization": f"Bearer {key}"}
        assert (await http.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers)).status_code == 200
        transport.down = True
        # Within the maximum age: last-known-good snapshot, and the key answers from the cache.
        assert (await http.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers)).status_code == 200
        await asyncio.sleep(0.8)
        response = await http.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers)
        assert response.status_code == (200 if fail_open else 503)
        # An unknown key cannot be checked while the registry is down: 503, not 401.
        unknown = await http.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer x"})
        assert unknown.status_code == 503 and "retry-after" in unknown.headers
        transport.down = False
        await router.feed.refresh()
        assert (await http.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers)).status_code == 200
