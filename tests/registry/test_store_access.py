"""Store: site tokens and API keys are shown once and stored only as hashes."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from registry.credentials import hash_secret
from registry.errors import InvalidInput, NotFound
from registry.records import ApiKeySpec, SiteSpec


def all_text(store, query: str) -> str:
    with store.engine.connect() as conn:
        return repr(conn.execute(text(query)).all())


def test_site_token_binds_to_its_site_and_is_stored_hashed(store):
    store.sites.create("fra-1", SiteSpec(), "alice")
    token = store.access.issue_site_token("fra-1", "alice")
    assert token.startswith("efs-")
    assert store.access.site_for_token(token).name == "fra-1"
    assert store.access.site_for_token(token + "x") is None
    stored = all_text(store, "SELECT * FROM site_tokens")
    assert token not in stored and hash_secret(token) in stored


def test_rotation_revokes_older_tokens(store):
    store.sites.create("fra-1", SiteSpec(), "alice")
    first = store.access.issue_site_token("fra-1", "alice")
    second = store.access.issue_site_token("fra-1", "alice")
    assert store.access.site_for_token(first) and store.access.site_for_token(second)
    rotated = store.access.issue_site_token("fra-1", "alice", revoke_previous=True)
    assert store.access.site_for_token(first) is None and store.access.site_for_token(second) is None
    assert store.access.site_for_token(rotated).name == "fra-1"
    with pytest.raises(NotFound):
        store.access.issue_site_token("nowhere", "alice")
    actions = [e.action for e in store.audit.list().items]
    assert actions[:3] == ["site_token.rotate", "site_token.issue", "site_token.issue"]


def test_api_key_lifecycle(store):
    key, secret = store.access.create_api_key(ApiKeySpec("team-a", ["us-east", "eu-west"], 60, 10_000), "alice")
    assert secret.startswith("ef-") and key.key_prefix == secret[:10]
    assert secret not in all_text(store, "SELECT * FROM api_keys")
    found = store.access.lookup_api_key(secret)
    assert found == key
    assert (found.allowed_regions, found.requests_per_minute, found.tokens_per_minute) == (["eu-west", "us-east"], 60, 10_000)
    assert store.access.lookup_api_key("ef-nope") is None
    revoked = store.access.revoke_api_key(key.id, "bob")
    assert revoked.revoked and revoked.revoked_at is not None
    assert store.access.revoke_api_key(key.id, "bob").revoked_at == revoked.revoked_at
    assert store.access.lookup_api_key(secret) is None
    assert store.access.get_api_key(key.id).revoked
    with pytest.raises(NotFound):
        store.access.revoke_api_key(999, "bob")


@pytest.mark.parametrize("spec, message", [
    (ApiKeySpec(""), "name"),
    (ApiKeySpec("k", ["EU"]), "allowed region"),
    (ApiKeySpec("k", requests_per_minute=0), "requests_per_minute"),
    (ApiKeySpec("k", tokens_per_minute=-5), "tokens_per_minute"),
])
def test_bad_api_keys_are_refused(store, spec, message):
    with pytest.raises(InvalidInput, match=message):
        store.access.create_api_key(spec, "alice")
    assert store.access.list_api_keys().items == []


def test_api_keys_page(store):
    ids = [store.access.create_api_key(ApiKeySpec(f"k{i}"), "alice")[0].id for i in range(5)]
    first = store.access.list_api_keys(limit=3)
    second = store.access.list_api_keys(limit=3, cursor=first.next_cursor)
    assert [k.id for k in first.items + second.items] == ids and second.next_cursor is None
    with pytest.raises(InvalidInput, match="cursor"):
        store.access.list_api_keys(cursor="abc")
