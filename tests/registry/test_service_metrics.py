"""The registry's /metrics after real traffic: heartbeats, snapshot requests, admin actions and
database failures move their counters by exactly what happened; sites by state and liveness
follow the operator's changes; only the metrics and admin tokens may scrape."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy.exc import OperationalError

from registry.client import RegistryError
from registry.service import create_app
from tests.metrics_text import Samples

from .conftest import ADMIN_TOKEN, ROUTER_TOKEN, new_site

METRICS_TOKEN = "scrape-secret"
IDLE = {"kv_blocks_total": 100, "kv_blocks_free": 100, "block_size": 16}


@pytest.fixture
async def app(db_url, store):
    """The service with a metrics token, lifespan running."""
    application = create_app(db_url, ADMIN_TOKEN, ROUTER_TOKEN, store=store, metrics_token=METRICS_TOKEN)
    async with application.router.lifespan_context(application):
        yield application


async def scrape(raw: httpx.AsyncClient) -> Samples:
    response = await raw.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return Samples.parse(response.text)


async def test_only_the_metrics_and_admin_tokens_may_scrape(raw):
    assert (await raw.get("/metrics")).status_code == 401
    assert (await raw.get("/metrics", headers={"Authorization": "Bearer nope"})).status_code == 401
    assert (await raw.get("/metrics", headers={"Authorization": f"Bearer {ROUTER_TOKEN}"})).status_code == 403
    assert (await raw.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})).status_code == 200
    assert (await raw.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})).status_code == 200
    # the scrape token opens nothing else
    denied = await raw.get("/v1/admin/sites", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert denied.status_code == 403
    assert "/metrics" not in (await raw.get("/openapi.json")).json()["paths"]


async def test_heartbeats_snapshots_and_admin_actions_move_their_counters(admin, connect, router_client, raw):
    site = await new_site(admin, connect, "fra-1")
    await new_site(admin, connect, "par-1")  # never heartbeats: not alive
    before = await scrape(raw)

    for free in (100, 90, 80):
        await site.heartbeat({**IDLE, "kv_blocks_free": free})
    with pytest.raises(RegistryError):
        await site.heartbeat({**IDLE, "kv_blocks_free": -1})
    document, etag = await router_client.snapshot()
    assert document is not None and (await router_client.snapshot(etag))[0] is None
    await admin.cordon("fra-1")
    with pytest.raises(RegistryError):
        await admin.cordon("nowhere")
    after = await scrape(raw)

    assert after.delta(before, "edgefire_registry_heartbeats_total", outcome="stored") == 3
    assert after.delta(before, "edgefire_registry_heartbeats_total", outcome="rejected") == 1
    assert after.delta(before, "edgefire_registry_heartbeat_latency_seconds_count") == 3
    assert after.delta(before, "edgefire_registry_heartbeat_commit_rows_sum") == 3
    assert after.delta(before, "edgefire_registry_snapshot_requests_total", status="200") == 1
    assert after.delta(before, "edgefire_registry_snapshot_requests_total", status="304") == 1
    assert after.delta(before, "edgefire_registry_snapshot_builds_total", step="render") >= 1
    assert after.delta(before, "edgefire_registry_admin_actions_total", action="cordon", status="200") == 1
    assert after.delta(before, "edgefire_registry_admin_actions_total", action="cordon", status="404") == 1
    assert after.get("edgefire_registry_sites", state="cordoned", alive="true") == 1
    assert after.get("edgefire_registry_sites", state="active", alive="false") == 1
    assert after.get("edgefire_registry_sites", state="active", alive="true") == 0
    assert after.get("edgefire_registry_sites") == 2


async def test_a_database_failure_is_counted_once(admin, store, raw, monkeypatch):
    await admin.create_site("fra-1")
    before = await scrape(raw)

    def down(*_args, **_kwargs):
        raise OperationalError("UPDATE sites", {}, Exception("the database went away"))

    monkeypatch.setattr(store.sites, "cordon", down)
    with pytest.raises(RegistryError) as err:
        await admin.cordon("fra-1")
    assert err.value.status == 503
    after = await scrape(raw)
    assert after.delta(before, "edgefire_registry_db_errors_total") == 1
    assert after.delta(before, "edgefire_registry_admin_actions_total", action="cordon", status="503") == 1
