"""Site-token caching: a token in steady use keeps working without waiting on the database, and a
token revoked on another replica (no cache flush here) stops working within the cache lifetime."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from registry import auth
from registry.auth import Authenticator
from registry.http_errors import ApiError
from registry.records import SiteSpec


@pytest.fixture
def short_cache(monkeypatch):
    monkeypatch.setattr(auth, "SITE_TOKEN_CACHE_S", 0.4)
    monkeypatch.setattr(auth, "SITE_TOKEN_REFRESH_S", 0.2)
    monkeypatch.setattr(auth, "REFRESH_WINDOW_S", 0.02)


async def test_steady_token_is_rechecked_in_the_background(store, short_cache):
    store.sites.create("fra-1", SiteSpec(), "alice")
    token = store.access.issue_site_token("fra-1", "alice")
    authenticator = Authenticator(store.access, "admin", "router")
    original = store.access.sites_for_tokens
    rechecking, release = threading.Event(), threading.Event()

    def stuck_lookup(tokens):  # a database that hangs until the test lets it answer
        rechecking.set()
        release.wait(10)
        return original(tokens)

    try:
        assert (await authenticator.site_for_header(f"Bearer {token}")).name == "fra-1"
        store.access.sites_for_tokens = stuck_lookup
        deadline = time.monotonic() + 5
        while not rechecking.is_set():  # used steadily until the cache entry is re-checked
            assert (await asyncio.wait_for(authenticator.site_for_header(f"Bearer {token}"), 1.0)).name == "fra-1"
            await asyncio.sleep(0.02)
            assert time.monotonic() < deadline, "the token was never re-checked"
        # the re-check hangs in the database; requests are still answered from the cache meanwhile
        assert (await asyncio.wait_for(authenticator.site_for_header(f"Bearer {token}"), 1.0)).name == "fra-1"
    finally:
        release.set()
        await authenticator.close()


async def test_token_revoked_elsewhere_stops_working_within_the_cache_lifetime(store, short_cache):
    store.sites.create("fra-1", SiteSpec(), "alice")
    token = store.access.issue_site_token("fra-1", "alice")
    authenticator = Authenticator(store.access, "admin", "router")
    try:
        await authenticator.site_for_header(f"Bearer {token}")
        store.access.issue_site_token("fra-1", "alice", revoke_previous=True)  # another replica rotates it
        revoked_at = time.monotonic()
        while True:
            await asyncio.sleep(0.02)
            try:
                await authenticator.site_for_header(f"Bearer {token}")
            except ApiError as exc:
                assert (exc.status, exc.code) == (401, "invalid_token")
                break
            assert time.monotonic() - revoked_at < auth.SITE_TOKEN_CACHE_S + 3.0, "the revoked token still works"
    finally:
        await authenticator.close()
