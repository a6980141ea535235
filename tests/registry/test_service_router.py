"""The routers' API: snapshot with ETag revalidation and liveness; API-key lookup."""

from __future__ import annotations

from registry.wire import PACKED_SNAPSHOT_MEDIA_TYPE

from .conftest import new_site

CAPACITY = {"kv_blocks_total": 100, "kv_blocks_free": 50, "block_size": 16}


async def test_snapshot_etag_roundtrip(admin, connect, router_client, raw):
    agent = await new_site(admin, connect)
    snapshot, etag = await router_client.snapshot()
    assert etag == f'"{snapshot["version"]}-packed-deflate"'  # the router's representation: packed, compressed
    assert await router_client.snapshot(etag) == (None, etag)
    response = await raw.get("/v1/router/snapshot", headers={"Authorization": "Bearer router-secret",
                                                             "Accept": PACKED_SNAPSHOT_MEDIA_TYPE,
                                                             "If-None-Match": etag})
    assert response.status_code == 304 and response.content == b""
    await agent.heartbeat(CAPACITY)
    changed, new_etag = await router_client.snapshot(etag)
    assert changed is not None and new_etag != etag
    await admin.cordon("fra-1")
    cordoned, _ = await router_client.snapshot(new_etag)
    assert cordoned["sites"][0]["state"] == "cordoned"


async def test_snapshot_reports_expired_sites_down(admin, connect, router_client, clock):
    agent = await new_site(admin, connect)
    await agent.register_site("fra-1", "10.0.0.1:1", [], heartbeat_interval_s=1.0)
    await agent.heartbeat(CAPACITY)
    snapshot, etag = await router_client.snapshot()
    assert snapshot["sites"][0]["alive"] is True
    clock.advance(3.5)  # TTL = 3 x 1 s
    expired, new_etag = await router_client.snapshot(etag)
    assert expired["sites"][0]["alive"] is False and new_etag != etag


async def test_lookup_api_key(admin, router_client):
    created = await admin.create_api_key("eu-only", ["eu-west"], requests_per_minute=10, tokens_per_minute=1000)
    info = await router_client.lookup_api_key(created["key"])
    assert {k: info[k] for k in ("id", "name", "allowed_regions", "requests_per_minute", "tokens_per_minute")} == {
        "id": created["id"], "name": "eu-only", "allowed_regions": ["eu-west"], "requests_per_minute": 10,
        "tokens_per_minute": 1000}
    assert await router_client.lookup_api_key("ef-unknown") is None
