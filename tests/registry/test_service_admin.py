"""The operator admin API through RegistryClient: every endpoint, pagination, idempotent PUTs, audit."""

from __future__ import annotations

import pytest

from registry.client import RegistryError

from .conftest import new_site

FRA = {"region": "eu-west", "country": "DE", "lat": 50.1, "lon": 8.7, "grpc_address": "10.0.0.1:50051"}


async def test_site_crud(admin):
    created = await admin.create_site("fra-1", **FRA, models=[{"model": "llama", "role": "both"}])
    assert created["name"] == "fra-1" and created["state"] == "active"
    assert await admin.get_site("fra-1") == created
    updated = await admin.update_site("fra-1", grpc_address="10.0.0.9:50051")
    assert updated["grpc_address"] == "10.0.0.9:50051" and updated["region"] == "eu-west"
    assert await admin.delete_site("fra-1") is None
    with pytest.raises(RegistryError) as err:
        await admin.get_site("fra-1")
    assert (err.value.status, err.value.code) == (404, "site_not_found")


async def test_list_sites_pages(admin):
    for i in range(5):
        await admin.create_site(f"site-{i}")
    first = await admin.list_sites(limit=2)
    names = [s["name"] for s in first["items"]]
    cursor = first["next_cursor"]
    while cursor:
        page = await admin.list_sites(limit=2, cursor=cursor)
        names += [s["name"] for s in page["items"]]
        cursor = page["next_cursor"]
    assert names == [f"site-{i}" for i in range(5)]


async def test_put_is_idempotent(admin, raw):
    first = await raw.put("/v1/admin/sites/fra-1", json=FRA, headers={"Authorization": "Bearer admin-secret"})
    second = await raw.put("/v1/admin/sites/fra-1", json=FRA, headers={"Authorization": "Bearer admin-secret"})
    assert (first.status_code, second.status_code) == (201, 200)
    strip = lambda site: {k: v for k, v in site.items() if k != "updated_at"}  # noqa: E731
    assert strip(first.json()) == strip(second.json())
    assert len((await admin.list_sites())["items"]) == 1


async def test_state_roles_models(admin):
    await admin.create_site("fra-1", **FRA)
    assert (await admin.cordon("fra-1"))["state"] == "cordoned"
    assert (await admin.cordon("fra-1"))["state"] == "cordoned"
    drained = await admin.drain("fra-1", 120)
    assert drained["state"] == "draining" and drained["drain_deadline"] > 0
    assert (await admin.uncordon("fra-1"))["state"] == "active"
    assert (await admin.set_roles("fra-1", ["prefill"]))["roles"] == ["prefill"]
    models = [{"model": "a", "role": "prefill"}, {"model": "b", "role": "decode"}]
    assert (await admin.set_models("fra-1", models))["models"] == models


async def test_site_tokens_are_shown_once_and_rotate(admin, connect):
    await admin.create_site("fra-1", **FRA)
    issued = await admin.issue_site_token("fra-1")
    agent = connect(issued["token"])
    await agent.heartbeat({"kv_blocks_total": 1, "kv_blocks_free": 1, "block_size": 1})
    rotated = await admin.rotate_site_token("fra-1")
    assert rotated["revoked_previous"] and rotated["token"] != issued["token"]
    with pytest.raises(RegistryError) as err:
        await agent.heartbeat({"kv_blocks_total": 1, "kv_blocks_free": 1, "block_size": 1})
    assert err.value.status == 401
    await connect(rotated["token"]).heartbeat({"kv_blocks_total": 1, "kv_blocks_free": 1, "block_size": 1})
    assert issued["token"] not in str(await admin.audit_log())


async def test_api_keys(admin, router_client):
    created = await admin.create_api_key("team-a", ["eu-west"], requests_per_minute=60, tokens_per_minute=5000)
    secret = created.pop("key")
    assert secret.startswith("ef-") and "key_hash" not in created
    assert (await admin.list_api_keys())["items"] == [created]
    assert await admin.get_api_key(created["id"]) == created
    assert (await router_client.lookup_api_key(secret))["allowed_regions"] == ["eu-west"]
    assert (await admin.revoke_api_key(created["id"]))["revoked"] is True
    assert await router_client.lookup_api_key(secret) is None
    for i in range(3):
        await admin.create_api_key(f"k{i}")
    page = await admin.list_api_keys(limit=2)
    rest = await admin.list_api_keys(limit=2, cursor=page["next_cursor"])
    assert len(page["items"]) + len(rest["items"]) == 4 and rest["next_cursor"] is None


async def test_audit_log_records_who_what_when(admin, connect):
    bob = connect("admin-secret")  # no X-Edgefire-Actor: recorded as plain "admin"
    await admin.create_site("fra-1", **FRA)
    await bob.cordon("fra-1")
    await admin.create_api_key("k")
    entries = (await admin.audit_log())["items"]
    assert [(e["actor"], e["action"], e["target"]) for e in entries] == [
        ("admin:alice", "api_key.create", "api-key:1"), ("admin", "site.cordon", "fra-1"),
        ("admin:alice", "site.create", "fra-1")]
    assert all(e["at"] > 0 for e in entries)
    page = await admin.audit_log(limit=1)
    assert (await admin.audit_log(limit=5, cursor=page["next_cursor"]))["items"] == entries[1:]


async def test_openapi_is_served(raw):
    spec = (await raw.get("/openapi.json")).json()
    for path in ("/v1/admin/sites", "/v1/agent/heartbeat", "/v1/router/snapshot", "/v1/admin/audit-log"):
        assert path in spec["paths"]


async def test_agent_tokens_and_router_token_cannot_administer(admin, connect, router_client):
    agent = await new_site(admin, connect)
    for client in (agent, router_client):
        with pytest.raises(RegistryError) as err:
            await client.create_site("evil")
        assert (err.value.status, err.value.code) == (403, "wrong_token_kind")
    assert [s["name"] for s in (await admin.list_sites())["items"]] == ["fra-1"]


HEARTBEAT = {"kv_blocks_total": 8, "kv_blocks_free": 8, "block_size": 16}


async def test_deleting_a_live_site_is_refused_and_keeps_its_agent_working(admin, connect):
    agent = await new_site(admin, connect)
    await agent.heartbeat(HEARTBEAT)
    with pytest.raises(RegistryError) as err:
        await admin.delete_site("fra-1")
    assert (err.value.status, err.value.code) == (409, "site_is_live")
    for advice in ("cordon", "drain", "force=true"):
        assert advice in err.value.message
    assert (await admin.get_site("fra-1"))["state"] == "active"
    assert (await agent.heartbeat(HEARTBEAT))["state"] == "active"   # its token still works
    assert (await admin.audit_log())["items"][0]["action"] != "site.delete"


async def test_a_forced_delete_of_a_live_site_is_audited_as_forced(admin, connect):
    agent = await new_site(admin, connect)
    await agent.heartbeat(HEARTBEAT)
    assert await admin.delete_site("fra-1", force=True) is None
    with pytest.raises(RegistryError) as err:
        await agent.heartbeat(HEARTBEAT)
    assert (err.value.status, err.value.code) == (410, "site_deleted")   # its agent learns why, and stops
    entry = (await admin.audit_log())["items"][0]
    assert (entry["actor"], entry["action"], entry["target"]) == ("admin:alice", "site.delete", "fra-1")
    assert entry["detail"]["force"] is True and entry["detail"]["live"] is True


@pytest.mark.parametrize("make_it_deletable", ["cordon", "drain", "heartbeat goes stale", "never heartbeated"])
async def test_a_site_that_is_not_live_deletes_without_force(admin, connect, clock, make_it_deletable):
    agent = await new_site(admin, connect, heartbeat_interval_s=2.0)
    if make_it_deletable != "never heartbeated":
        await agent.heartbeat(HEARTBEAT)
    if make_it_deletable == "cordon":
        await admin.cordon("fra-1")
    elif make_it_deletable == "drain":
        await admin.drain("fra-1", 30)
    elif make_it_deletable == "heartbeat goes stale":
        clock.advance(3 * 2.0 + 0.5)   # past the snapshot's liveness: TTL_HEARTBEATS intervals
        assert not (await admin.admin_snapshot())["sites"][0]["alive"]
    assert await admin.delete_site("fra-1") is None
    assert (await admin.list_sites())["items"] == []
    assert (await admin.audit_log())["items"][0]["detail"]["force"] is False


async def test_uncordoning_a_site_whose_agent_is_still_draining_is_refused(admin, connect, clock):
    """The draining agent exits whatever the registry says: an uncordon then would show "active" for a
    site about to vanish. Refused with what to do instead; allowed once the agent has deregistered."""
    agent = await new_site(admin, connect, heartbeat_interval_s=2.0)
    await agent.heartbeat(HEARTBEAT)
    await admin.drain("fra-1", 30)
    assert (await agent.heartbeat({**HEARTBEAT, "draining": True}))["state"] == "draining"
    with pytest.raises(RegistryError) as err:
        await admin.uncordon("fra-1")
    assert (err.value.status, err.value.code) == (409, "site_is_draining")
    assert "once its agent has stopped" in err.value.message
    assert (await admin.get_site("fra-1"))["state"] == "draining"
    assert (await admin.audit_log())["items"][0]["action"] == "site.drain"
    await agent.deregister()
    assert (await admin.uncordon("fra-1"))["state"] == "active"
    assert (await admin.audit_log())["items"][0]["action"] == "site.uncordon"


async def test_a_drained_site_whose_heartbeat_went_stale_uncordons(admin, connect, clock):
    agent = await new_site(admin, connect, heartbeat_interval_s=2.0)
    await agent.heartbeat(HEARTBEAT)
    await admin.drain("fra-1", 30)
    clock.advance(3 * 2.0 + 0.5)   # past the liveness TTL: the agent is gone without deregistering
    assert (await admin.uncordon("fra-1"))["state"] == "active"
    assert (await agent.heartbeat(HEARTBEAT))["state"] == "active"   # a restarted agent serves again


async def test_a_repeated_cordon_or_uncordon_is_audited_once(admin):
    await admin.create_site("fra-1", **FRA)
    for change in (admin.cordon, admin.cordon, admin.uncordon, admin.uncordon):
        await change("fra-1")
    actions = [e["action"] for e in (await admin.audit_log())["items"]]
    assert actions == ["site.uncordon", "site.cordon", "site.create"]
    assert (await admin.uncordon("fra-1"))["state"] == "active"   # still answered with the site
