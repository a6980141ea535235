"""POST /v1/embeddings at its edges: a `dimensions` past what the agent wire can carry is a 400 naming it, a
failure of the router's own is a 500 counted under the route "embeddings" like every other answer, and a
client that leaves mid-call ends the site's Embed call (the site stops embedding for no one)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import generate_latest
from router_fake_agent import MODEL, FakeAgent

from router.embeddings import EmbeddingService
from tests.metrics_text import Samples


@pytest.fixture
async def endpoint(cluster, make_router):
    await cluster.add_site("waw", 52.2, 21.0)
    router, url = await make_router()
    return router, url, await cluster.create_key()


@pytest.mark.parametrize("dimensions", [2**32, 2**40])
async def test_dimensions_past_any_model_is_a_400_naming_it(endpoint, http, dimensions):
    router, url, key = endpoint
    response = await http.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "edge", "dimensions": dimensions},
                               headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "dimensions" and str(dimensions) in error["message"]
    samples = Samples.parse(generate_latest(router.metrics.registry).decode())
    assert samples.get("edgefire_router_requests_total", route="embeddings", status="400") == 1


async def test_a_router_failure_is_a_500_counted_under_embeddings(endpoint, http, monkeypatch):
    router, url, key = endpoint

    async def broken(self, request, ctx):
        raise RuntimeError("a bug in the router")

    monkeypatch.setattr(EmbeddingService, "embed", broken)
    response = await http.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "edge"},
                               headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    assert response.headers["x-request-id"]
    samples = Samples.parse(generate_latest(router.metrics.registry).decode())
    assert samples.get("edgefire_router_requests_total", model=MODEL, route="embeddings", status="500") == 1


async def test_a_client_that_leaves_ends_the_sites_embed_call(cluster, make_router, monkeypatch):
    started, ended = asyncio.Event(), asyncio.Event()

    async def slow_embed(self, request, context):
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            ended.set()

    monkeypatch.setattr(FakeAgent, "Embed", slow_embed)   # before the site's server registers its methods
    await cluster.add_site("waw", 52.2, 21.0)
    _router, url = await make_router(first_token_timeout_s=60.0)
    key = await cluster.create_key()
    async with httpx.AsyncClient(timeout=60) as client:
        request = asyncio.ensure_future(client.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "edge"},
                                                    headers={"authorization": f"Bearer {key}"}))
        await asyncio.wait_for(started.wait(), 10)
        request.cancel()   # the client leaves: its connection closes
        with pytest.raises(asyncio.CancelledError):
            await request
    await asyncio.wait_for(ended.wait(), 10)   # the site's call was cancelled, not left to run out its deadline


async def test_a_call_whose_inputs_together_exceed_every_sites_free_kv_is_placed(cluster, make_router, http):
    """A site takes an Embed call when its free KV holds the longest input (the inputs then run as blocks free up:
    node_agent.core.accept_embedding); the router places by the same measure, not by the inputs' sum, which no
    site's free KV holds (that was a 503 "no site with free capacity", on every retry)."""
    await cluster.add_site("waw", 52.2, 21.0, kv_blocks_total=50, kv_blocks_free=50)   # 800 tokens free
    _router, url = await make_router()
    key = await cluster.create_key()
    inputs = [[(11 * i + j) % 200 + 10 for j in range(300)] for i in range(4)]   # 1,200 tokens in all
    response = await http.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": inputs},
                               headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 4 and response.json()["usage"]["prompt_tokens"] == 1200
    too_long = [[5] * 900]   # one input past the site's free KV: no site can take it now
    response = await http.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": too_long},
                               headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 503, response.text
