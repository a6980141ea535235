"""POST /v1/embeddings at two more edges: an input as long as the model's context is placed on a site whose free KV
holds exactly that (an embedding generates no token, so placement keeps no block for one and wants no decode site),
while completions still keep that block; and one Embed call's deadline grows with its tokens, at the site's
measured prefill rate, up to the router's request timeout."""

from __future__ import annotations

import pytest
from router_fake_agent import MODEL

from node_agent.client import AgentClient
from router.placement import PlacementRequest, rank

BLOCK_SIZE = 16   # the fake agents' (tests/router/conftest.py IDLE)
WAW = (52.2, 21.0)


def token_ids(num_tokens: int, seed: int = 0) -> list[int]:
    return [(7 * j + 13 * seed) % 200 + 10 for j in range(num_tokens)]


@pytest.fixture
def embed_timeouts(monkeypatch) -> list[float]:
    """The timeout of every Embed call the router makes (the call itself goes on to the site)."""
    real_embed, timeouts = AgentClient.embed, []

    async def recorded(self, request, timeout=None):
        timeouts.append(timeout)
        return await real_embed(self, request, timeout)

    monkeypatch.setattr(AgentClient, "embed", recorded)
    return timeouts


async def test_an_input_as_long_as_the_context_fits_a_site_whose_kv_is_the_context(cluster, make_router, http):
    context = cluster.model_info.context_length
    agent = await cluster.add_site("waw", *WAW, kv_blocks_total=context // BLOCK_SIZE,
                                   kv_blocks_free=context // BLOCK_SIZE)
    router, url = await make_router()
    key = await cluster.create_key()
    headers = {"authorization": f"Bearer {key}"}
    ids = token_ids(context)

    response = await http.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": ids}, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == context
    assert response.headers["x-edgefire-prefill-site"] == "waw"
    (embed,) = [request for method, request in agent.calls if method == "Embed"]
    assert list(embed.inputs[0].token_ids) == ids

    # A completion needs room for its generated token too, as the agent admits it: the same prompt finds no site,
    # and one a token shorter (which the context allows with max_tokens 1) fits exactly and is served.
    snapshot, cost = router.service.feed.current(), router.service.cost
    assert rank(snapshot, PlacementRequest(MODEL, ids, 1, *WAW), cost) == []
    assert [c.prefill_site.name for c in rank(snapshot, PlacementRequest(MODEL, ids, 0, *WAW, prefill_only=True),
                                              cost)] == ["waw"]
    response = await http.post(f"{url}/v1/completions", headers=headers,
                               json={"model": MODEL, "prompt": ids[:-1], "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == context - 1


async def test_an_embed_calls_deadline_grows_with_its_tokens_up_to_the_request_timeout(
        cluster, make_router, http, embed_timeouts):
    await cluster.add_site("waw", *WAW, prefill_tokens_per_s=100.0)
    _router, url = await make_router(first_token_timeout_s=2.0, request_timeout_s=20.0)
    key = await cluster.create_key()
    calls = [[token_ids(10)], [token_ids(300)], [token_ids(300, seed) for seed in range(4)]]   # 10, 300, 1,200 tokens
    for inputs in calls:
        response = await http.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": inputs},
                                   headers={"authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
    assert len(embed_timeouts) == 3
    small, large, largest = embed_timeouts
    assert 2.0 < small < large < largest   # more tokens, more time; each past the first-token timeout
    assert largest == 20.0                 # 1,200 tokens at 100 a second would be far more: capped


async def test_an_embed_call_on_a_site_with_no_measured_rate_gets_the_request_timeout(
        cluster, make_router, http, embed_timeouts):
    await cluster.add_site("waw", *WAW)   # no prefill rate measured yet
    _router, url = await make_router(first_token_timeout_s=2.0, request_timeout_s=20.0)
    key = await cluster.create_key()
    response = await http.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": [token_ids(300)]},
                               headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    assert embed_timeouts == [20.0]
