"""A deleted site leaves tombstones: its agent's token is answered 410 `site_deleted` (naming the site,
when and by whom), not 401, so the agent can stop; unknown tokens stay 401; a site created again under
the same name works with its new token, and the old one still says its site was deleted. On SQLite and
PostgreSQL."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
from sqlalchemy import text

from registry import auth
from registry.auth import Authenticator
from registry.client import RegistryError
from registry.http_errors import ApiError
from registry.records import SiteSpec
from registry.tombstones import TOMBSTONE_TTL_S, iso_time

from .conftest import new_site

HEARTBEAT = {"kv_blocks_total": 8, "kv_blocks_free": 8, "block_size": 16}
REGISTRATION = ("fra-1", "10.0.0.1:50051", [{"model": "llama", "role": "both"}])


async def refusal(call) -> RegistryError:
    with pytest.raises(RegistryError) as err:
        await call
    return err.value


def sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def tombstone_rows(store, tokens: list[str]) -> list:
    """The tombstones of these tokens (the PostgreSQL schema is shared by the session's tests)."""
    with store.engine.connect() as conn:
        rows = conn.execute(text("SELECT token_hash, site_name, deleted_at, deleted_by FROM site_tombstones "
                                 "ORDER BY token_hash")).all()
    return [row for row in rows if row.token_hash in {sha256(token) for token in tokens}]


async def site_with_token(admin, connect, name: str = "fra-1"):
    await admin.create_site(name, region="eu-west")
    token = (await admin.issue_site_token(name))["token"]
    return connect(token), token


async def test_a_deleted_draining_sites_tokens_are_answered_410_site_deleted(admin, connect, raw, store, clock):
    await admin.create_site("fra-1", region="eu-west")
    first_token, second_token = [(await admin.issue_site_token("fra-1"))["token"] for _ in range(2)]
    agent = connect(first_token)
    await agent.register_site(*REGISTRATION)
    await agent.heartbeat(HEARTBEAT)
    await admin.drain("fra-1", 60)
    assert await admin.delete_site("fra-1") is None   # a draining site deletes while its agent runs

    for call in (agent.heartbeat(HEARTBEAT), agent.register_site(*REGISTRATION), agent.peers(),
                 connect(second_token).heartbeat(HEARTBEAT)):
        err = await refusal(call)
        assert (err.status, err.code) == (410, "site_deleted")
        assert f"site 'fra-1' was deleted from the registry at {iso_time(clock.now)} by admin:alice" in err.message
        assert err.fields == {"site": "fra-1", "deleted_at": clock.now, "deleted_by": "admin:alice"}
    # the heartbeat's fast path answers with the same body as FastAPI's routes
    response = await raw.post("/v1/agent/heartbeat", json=HEARTBEAT, headers={"Authorization": f"Bearer {second_token}"})
    assert response.status_code == 410 and response.json()["error"]["code"] == "site_deleted"
    assert response.json()["error"]["type"] == "authentication_error"

    stranger = await refusal(connect("efs-never-issued").heartbeat(HEARTBEAT))
    assert (stranger.status, stranger.code) == (401, "invalid_token")
    # the table keeps the tokens' hashes, never the tokens
    rows = tombstone_rows(store, [first_token, second_token])
    assert [row.token_hash for row in rows] == sorted(sha256(t) for t in (first_token, second_token))
    assert {(row.site_name, row.deleted_at, row.deleted_by) for row in rows} == {("fra-1", clock.now, "admin:alice")}
    with store.engine.connect() as conn:
        stored = " ".join(str(value) for row in conn.execute(text("SELECT * FROM site_tombstones")) for value in row)
    assert first_token not in stored and second_token not in stored
    entry = (await admin.audit_log())["items"][0]
    assert (entry["action"], entry["detail"]["tokens_tombstoned"]) == ("site.delete", 2)


async def test_only_the_tokens_the_site_still_had_are_tombstoned(admin, connect):
    old = await new_site(admin, connect)
    current = connect((await admin.rotate_site_token("fra-1"))["token"])
    await admin.cordon("fra-1")
    await admin.delete_site("fra-1")
    assert (await refusal(current.heartbeat(HEARTBEAT))).status == 410
    revoked = await refusal(old.heartbeat(HEARTBEAT))   # revoked before the delete: unknown, as ever
    assert (revoked.status, revoked.code) == (401, "invalid_token")


async def test_a_site_created_again_under_the_name_works_and_the_old_token_still_says_deleted(admin, connect, clock):
    old = await new_site(admin, connect)
    await old.heartbeat(HEARTBEAT)
    await admin.delete_site("fra-1", force=True)
    first_deleted_at = clock.now
    clock.advance(60)

    new = await new_site(admin, connect)   # same name, new token
    assert (await new.register_site(*REGISTRATION))["grpc_address"] == "10.0.0.1:50051"
    assert (await new.heartbeat(HEARTBEAT))["state"] == "active"
    assert (await admin.admin_snapshot())["sites"][0]["alive"]
    err = await refusal(old.heartbeat(HEARTBEAT))
    assert (err.status, err.fields["deleted_at"]) == (410, first_deleted_at)

    await admin.cordon("fra-1")
    await admin.delete_site("fra-1")   # the second incarnation's token gets its own tombstone
    assert (await refusal(new.heartbeat(HEARTBEAT))).fields["deleted_at"] == clock.now
    assert (await refusal(old.heartbeat(HEARTBEAT))).fields["deleted_at"] == first_deleted_at


async def test_tombstones_are_kept_30_days_then_the_token_is_unknown(admin, connect, store, clock):
    old, old_token = await site_with_token(admin, connect)
    await admin.delete_site("fra-1")
    clock.advance(TOMBSTONE_TTL_S - 60)
    assert (await refusal(old.heartbeat(HEARTBEAT))).status == 410
    clock.advance(120)
    err = await refusal(old.heartbeat(HEARTBEAT))
    assert (err.status, err.code) == (401, "invalid_token")
    # the next delete prunes what has expired
    _, new_token = await site_with_token(admin, connect, "ams-1")
    await admin.delete_site("ams-1")
    assert [row.site_name for row in tombstone_rows(store, [old_token, new_token])] == ["ams-1"]


async def test_a_token_cached_on_another_replica_turns_410_within_the_cache_lifetime(store, monkeypatch):
    monkeypatch.setattr(auth, "SITE_TOKEN_CACHE_S", 0.4)
    monkeypatch.setattr(auth, "SITE_TOKEN_REFRESH_S", 0.2)
    monkeypatch.setattr(auth, "REFRESH_WINDOW_S", 0.02)
    store.sites.create("fra-1", SiteSpec(), "alice")
    token = store.access.issue_site_token("fra-1", "alice")
    replica = Authenticator(store.access, "admin", "router")
    try:
        assert (await replica.site_for_header(f"Bearer {token}")).name == "fra-1"
        store.sites.delete("fra-1", "bob")   # on another replica: this one's cache is not flushed
        deleted_at = time.monotonic()
        while True:
            await asyncio.sleep(0.02)
            try:
                await replica.site_for_header(f"Bearer {token}")
            except ApiError as exc:
                assert (exc.status, exc.code, exc.fields["deleted_by"]) == (410, "site_deleted", "bob")
                break
            assert time.monotonic() - deleted_at < auth.SITE_TOKEN_CACHE_S + 3.0, "the deleted site's token still works"
    finally:
        await replica.close()
