"""Embeddings during a rollout: a site whose agent predates the Embed call answers UNIMPLEMENTED; the router moves
on to a site that embeds without marking the older one broken (it still serves completions), and when no site can
embed yet it says so (503 naming the cause), not as a failure of the sites."""

from __future__ import annotations

import grpc
import pytest

from prometheus_client import generate_latest
from router_fake_agent import MODEL

from tests.metrics_text import Samples


@pytest.fixture
async def rollout(cluster, make_router):
    older = await cluster.add_site("fra", 50.1, 8.7)          # nearest the router: tried first
    older.refuse, older.refuse_methods = grpc.StatusCode.UNIMPLEMENTED, frozenset({"Embed"})
    newer = await cluster.add_site("waw", 52.2, 21.0)
    router, url = await make_router()
    return router, url, await cluster.create_key(), older, newer


async def test_an_agent_without_embed_is_passed_over_and_not_marked_broken(rollout, http):
    router, url, key, older, newer = rollout
    response = await http.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": ["one", "two"]},
                               headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    assert response.headers["x-edgefire-prefill-site"] == "waw" and len(response.json()["data"]) == 2
    assert "Embed" in [method for method, _ in older.calls]   # tried first, passed over
    samples = Samples.parse(generate_latest(router.metrics.registry).decode())
    assert not samples.get("edgefire_router_site_failures_total", site="fra", reason="unimplemented")
    chat = await http.post(f"{url}/v1/chat/completions", json={"model": MODEL, "max_tokens": 3,
                                                                "messages": [{"role": "user", "content": "hi"}]},
                           headers={"authorization": f"Bearer {key}"})
    assert chat.status_code == 200 and chat.headers["x-edgefire-decode-site"] == "fra"   # not cooled down


async def test_no_site_that_can_embed_is_a_503_naming_the_cause(rollout, http):
    _router, url, key, _older, newer = rollout
    newer.refuse, newer.refuse_methods = grpc.StatusCode.UNIMPLEMENTED, frozenset({"Embed"})
    response = await http.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "one"},
                               headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 503 and "predate embeddings" in response.json()["error"]["message"]
