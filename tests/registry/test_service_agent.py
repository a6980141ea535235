"""The agents' API: registration bound to the token's site, heartbeats, links, deregistration."""

from __future__ import annotations

import pytest

from registry.client import RegistryError

from .conftest import new_site

CAPACITY = {"kv_blocks_total": 4096, "kv_blocks_free": 1024, "block_size": 16, "num_running": 3, "num_waiting": 1,
            "inflight_prefill_tokens": 900, "inflight_decode_tokens": 40, "prefill_tokens_per_s": 8000.0,
            "decode_tokens_per_s": 300.0, "prefix_cache_summary": {"block_size": 16, "hashes": ["9f86d081884c7d65"]},
            "draining": False}


def site_in(snapshot: dict, name: str) -> dict:
    return next(s for s in snapshot["sites"] if s["name"] == name)


async def test_register_updates_endpoint_and_models(admin, connect):
    agent = await new_site(admin, connect)
    site = await agent.register_site("fra-1", "10.1.2.3:50051", [{"model": "llama", "role": "decode"}],
                                     heartbeat_interval_s=1.0, lat=50.0, lon=8.0)
    assert (site["grpc_address"], site["heartbeat_interval_s"], site["lat"]) == ("10.1.2.3:50051", 1.0, 50.0)
    assert site["models"] == [{"model": "llama", "role": "decode"}] and site["region"] == "eu-west"
    assert (await admin.audit_log())["items"][0]["actor"] == "site:fra-1"


async def test_registered_kv_figures_reach_the_snapshot(admin, connect, router_client):
    """An agent registers its own KV figures per model (its dtype's bytes per token, its KV format);
    routers read them from the snapshot. A model registered without them carries none."""
    agent = await new_site(admin, connect)
    served = [{"model": "llama", "role": "both", "kv_bytes_per_token": 65536, "kv_format": "bfloat16/32x8x128/9e1f"},
              {"model": "qwen", "role": "decode"}]
    site = await agent.register_site("fra-1", "10.1.2.3:50051", served)
    assert site["models"] == served
    await agent.heartbeat(CAPACITY)
    assert site_in((await router_client.snapshot())[0], "fra-1")["models"] == served
    assert (await admin.get_site("fra-1"))["models"] == served


async def test_token_is_bound_to_one_site(admin, connect):
    agent = await new_site(admin, connect)
    await admin.create_site("ams-1")
    with pytest.raises(RegistryError) as err:
        await agent.register_site("ams-1", "10.0.0.1:1", [])
    assert (err.value.status, err.value.code) == (403, "wrong_site")
    assert (await admin.get_site("ams-1"))["grpc_address"] is None


async def test_register_validates(admin, connect):
    agent = await new_site(admin, connect)
    for bad in ({"grpc_address": "no-port", "models": []},
                {"grpc_address": "h:1", "models": [{"model": "m", "role": "everything"}]},
                {"grpc_address": "h:1", "models": [], "heartbeat_interval_s": -1},
                {"grpc_address": "h:1", "models": [{"model": "m", "kv_bytes_per_token": 0}]},
                {"grpc_address": "h:1", "models": [{"model": "m", "kv_bytes_per_token": 2**41}]},
                {"grpc_address": "h:1", "models": [{"model": "m", "kv_bytes_per_token": "wide"}]},
                {"grpc_address": "h:1", "models": [{"model": "m", "kv_format": ""}]},
                {"grpc_address": "h:1", "models": [{"model": "m", "kv_format": "x" * 201}]}):
        with pytest.raises(RegistryError) as err:
            await agent._call("PUT", "/v1/agent/registration", json=bad)
        assert err.value.status == 422
    assert (await admin.get_site("fra-1"))["grpc_address"] is None


async def test_heartbeat_reaches_the_snapshot_and_returns_intent(admin, connect, router_client):
    agent = await new_site(admin, connect)
    assert await agent.heartbeat(CAPACITY) == {"state": "active", "drain_deadline": None, "active_role": None}
    site = site_in((await router_client.snapshot(packed=False))[0], "fra-1")
    assert site["alive"] is True
    assert {k: site["capacity"][k] for k in CAPACITY} == CAPACITY
    await admin.drain("fra-1", 30)
    reply = await agent.heartbeat(CAPACITY)
    assert reply["state"] == "draining" and reply["drain_deadline"] > 0


@pytest.mark.parametrize("change", [{"kv_blocks_free": 5000}, {"block_size": 0}, {"num_running": -1},
                                    {"kv_blocks_total": "lots"}, {"unknown_field": 1}, {"prefix_cache_summary": [1]}])
async def test_bad_heartbeats_are_422(admin, connect, router_client, change):
    agent = await new_site(admin, connect)
    with pytest.raises(RegistryError) as err:
        await agent.heartbeat({**CAPACITY, **change})
    assert err.value.status == 422
    assert site_in((await router_client.snapshot())[0], "fra-1")["capacity"] is None


async def test_heartbeat_after_site_deleted_is_refused(admin, connect):
    agent = await new_site(admin, connect)
    await agent.heartbeat(CAPACITY)
    await admin.delete_site("fra-1", force=True)
    with pytest.raises(RegistryError) as err:
        await agent.heartbeat(CAPACITY)
    assert (err.value.status, err.value.code) == (410, "site_deleted")


async def test_links(admin, connect, router_client):
    agent = await new_site(admin, connect)
    await admin.create_site("ams-1")
    assert await agent.post_links([{"peer": "ams-1", "rtt_ms": 7.5, "bandwidth_mbps": 2000.0}]) == {"stored": 1}
    links = (await router_client.snapshot())[0]["links"]
    assert [(l["src"], l["dst"], l["rtt_ms"], l["bandwidth_mbps"]) for l in links] == [("fra-1", "ams-1", 7.5, 2000.0)]
    with pytest.raises(RegistryError) as err:
        await agent.post_links([{"peer": "ams-1", "rtt_ms": 1, "bandwidth_mbps": 1}, {"peer": "ghost", "rtt_ms": 1,
                                                                                   "bandwidth_mbps": 1}])
    assert (err.value.status, err.value.code) == (422, "unknown_peer")
    assert (await router_client.snapshot())[0]["links"][0]["rtt_ms"] == 7.5


async def test_deregister_takes_site_out_at_once(admin, connect, router_client):
    agent = await new_site(admin, connect)
    await agent.heartbeat(CAPACITY)
    assert await agent.deregister() is None
    site = site_in((await router_client.snapshot())[0], "fra-1")
    assert (site["alive"], site["capacity"]) == (False, None)
    await agent.heartbeat(CAPACITY)  # coming back is just heartbeating again
    assert site_in((await router_client.snapshot())[0], "fra-1")["alive"] is True
