"""RegistryClient and SyncRegistryClient against a real uvicorn server on loopback."""

from __future__ import annotations

import socket

import httpx
import pytest

from registry.client import RegistryClient, RegistryError, SyncRegistryClient

from .conftest import ADMIN_TOKEN, ROUTER_TOKEN


def test_sync_client_admin_round_trip(live_server):
    with SyncRegistryClient(live_server, ADMIN_TOKEN, actor="cli") as admin:
        admin.create_site("fra-1", region="eu-west", country="DE", lat=50.1, lon=8.7)
        assert admin.issue_site_token("fra-1")["token"].startswith("efs-")
        with pytest.raises(RegistryError) as err:
            admin.create_site("fra-1")
        assert (err.value.status, err.value.code) == (409, "duplicate_site")
        assert "already exists" in str(err.value)
        assert [s["name"] for s in admin.list_sites()["items"]] == ["fra-1"]
        assert admin.audit_log()["items"][0]["actor"] == "admin:cli"


async def test_async_clients_against_live_server(live_server):
    async with RegistryClient(live_server, ADMIN_TOKEN) as admin:
        await admin.create_site("fra-1", region="eu-west", country="DE", lat=50.1, lon=8.7)
        token = (await admin.issue_site_token("fra-1"))["token"]
    async with RegistryClient(live_server, token) as agent, RegistryClient(live_server, ROUTER_TOKEN) as router:
        await agent.register_site("fra-1", "127.0.0.1:50051", [{"model": "m", "role": "both"}])
        await agent.heartbeat({"kv_blocks_total": 8, "kv_blocks_free": 8, "block_size": 16})
        snapshot, etag = await router.snapshot()
        assert snapshot["sites"][0]["alive"] is True and snapshot["sites"][0]["grpc_address"] == "127.0.0.1:50051"
        assert await router.snapshot(etag) == (None, etag)


async def test_connection_errors_surface_as_httpx_errors():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: nothing listens there
    async with RegistryClient(f"http://127.0.0.1:{port}", "t", timeout=1.0) as client:
        with pytest.raises(httpx.ConnectError):
            await client.heartbeat({"kv_blocks_total": 1, "kv_blocks_free": 1, "block_size": 1})


def test_error_bodies_that_are_not_ours_still_raise_registry_error():
    transport = httpx.MockTransport(lambda request: httpx.Response(502, text="bad gateway"))
    with SyncRegistryClient("http://registry", "t", transport=transport) as client:
        with pytest.raises(RegistryError) as err:
            client.list_sites()
    assert (err.value.status, err.value.message, err.value.code) == (502, "bad gateway", None)
