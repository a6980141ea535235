"""A deleted site's token still cached by another registry replica (its cache lives SITE_TOKEN_CACHE_S):
what that replica answers the old agent in that window. The agent must learn at once that its site was
deleted (410 `site_deleted`), and must never reach the site created again under the same name. On SQLite
and PostgreSQL, two replicas over one database."""

from __future__ import annotations

import httpx
import pytest

from registry.client import RegistryClient, RegistryError
from registry.db import make_engine
from registry.service import create_app
from registry.store import RegistryStore

from .conftest import ADMIN_TOKEN, ROUTER_TOKEN

HEARTBEAT = {"kv_blocks_total": 8, "kv_blocks_free": 8, "block_size": 16}
MODELS = [{"model": "llama", "role": "both"}]


@pytest.fixture
async def other_replica(db_url, clock):
    """connect(token) -> a client of a second registry replica over the same database (its own token cache)."""
    replica_store = RegistryStore(make_engine(db_url), clock)
    application = create_app(db_url, ADMIN_TOKEN, ROUTER_TOKEN, store=replica_store)
    clients: list[RegistryClient] = []
    async with application.router.lifespan_context(application):
        def make(token: str) -> RegistryClient:
            client = RegistryClient("http://replica-b", token, transport=httpx.ASGITransport(application))
            clients.append(client)
            return client

        yield make
        for client in clients:
            await client.aclose()


async def refusal(call) -> RegistryError:
    with pytest.raises(RegistryError) as err:
        await call
    return err.value


async def deleted_site_with_cached_token(admin, other_replica):
    """fra-1's agent heartbeats through replica B (which caches its token); the operator deletes fra-1
    through replica A. Returns the old agent's client on replica B."""
    await admin.create_site("fra-1", region="eu-west")
    old_agent = other_replica((await admin.issue_site_token("fra-1"))["token"])
    await old_agent.register_site("fra-1", "10.0.0.1:50051", MODELS)
    await old_agent.heartbeat(HEARTBEAT)
    await admin.cordon("fra-1")
    await admin.delete_site("fra-1")
    return old_agent


async def test_a_deleted_sites_agent_cannot_re_register_over_the_site_created_again(admin, connect, other_replica):
    old_agent = await deleted_site_with_cached_token(admin, other_replica)
    await admin.create_site("fra-1", region="eu-west")   # a new machine takes the name
    new_agent = connect((await admin.issue_site_token("fra-1"))["token"])
    await new_agent.register_site("fra-1", "10.0.0.2:50051", MODELS)

    await new_agent.heartbeat(HEARTBEAT)

    await old_agent.deregister()   # the old agent leaving (stopped by hand) does not take the new site down
    err = await refusal(old_agent.register_site("fra-1", "10.0.0.1:50051", MODELS))
    assert (err.status, err.code, err.fields["site"]) == (410, "site_deleted", "fra-1")
    assert (await refusal(old_agent.heartbeat(HEARTBEAT))).status == 410
    # routers keep placing fra-1 on the new machine, not on the deleted site's agent
    assert (await admin.get_site("fra-1"))["grpc_address"] == "10.0.0.2:50051"
    assert [site["alive"] for site in (await admin.admin_snapshot())["sites"]] == [True]


async def test_a_heartbeat_through_a_replica_that_cached_the_token_is_answered_410(admin, other_replica):
    old_agent = await deleted_site_with_cached_token(admin, other_replica)
    err = await refusal(old_agent.heartbeat(HEARTBEAT))
    assert (err.status, err.code, err.fields["deleted_by"]) == (410, "site_deleted", "admin:alice")


async def test_link_reports_through_a_replica_that_cached_the_token_are_answered_410(admin, connect, other_replica):
    await admin.create_site("ams-1", region="eu-west")
    old_agent = await deleted_site_with_cached_token(admin, other_replica)
    err = await refusal(old_agent.post_links([{"peer": "ams-1", "rtt_ms": 5.0, "bandwidth_mbps": 1000.0}]))
    assert (err.status, err.code) == (410, "site_deleted")
