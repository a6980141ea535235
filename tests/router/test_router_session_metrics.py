"""A router's /metrics for its Session streams to agents (node_agent.client.AgentSession): sessions open
per site, sessions broken mid-stream and requests sent per request to agents without the RPC, each moving
by exactly what happened. Real in-process agents (test_router_session's harness) and fake agents without
the Session RPC."""

from __future__ import annotations

import asyncio

import httpx
from router_fake_agent import MODEL as FAKE_MODEL
from test_router_session import body, broken_session, sites, stream_text

from tests.metrics_text import Samples

OPEN = "edgefire_router_agent_sessions_open"
BREAKS = "edgefire_router_agent_session_breaks_total"
PER_REQUEST = "edgefire_router_agent_per_request_calls_total"


async def scrape(http, router) -> Samples:
    response = await http.get(f"http://127.0.0.1:{router.metrics_port}/metrics")
    assert response.status_code == 200
    return Samples.parse(response.text)


async def test_sessions_open_per_site_and_none_broken_after_traffic(cluster, make_router, tiny_model_dir):
    async with sites(cluster, make_router, tiny_model_dir, metrics_listen="127.0.0.1:0") as (router, url, key, agents):
        async with httpx.AsyncClient(timeout=120) as http:
            before = await scrape(http, router)
            assert {series["site"]: before.get(OPEN, **series) for series in before.series(OPEN)} == \
                {name: 0 for name in agents}
            answers = await asyncio.gather(*(stream_text(http, url, key, body(i)) for i in range(6)))
            after = await scrape(http, router)
    used = {site for _, site in answers}
    for name in agents:
        assert after.get(OPEN, site=name) == (1 if name in used else 0), name
        assert after.delta(before, BREAKS, site=name) == 0
        assert after.delta(before, PER_REQUEST, site=name) == 0


async def test_a_session_broken_mid_stream_counts_one_break_for_its_site(cluster, make_router, tiny_model_dir):
    async with sites(cluster, make_router, tiny_model_dir, metrics_listen="127.0.0.1:0") as (router, url, key, agents):
        async with httpx.AsyncClient(timeout=120) as http:
            _, first_site = await stream_text(http, url, key, body(0, 40))
            before = await scrape(http, router)
            with broken_session(agents[first_site].servicer, 6) as broken:
                await asyncio.gather(*(stream_text(http, url, key, body(i, 40)) for i in range(3)))
            assert broken.num_batches >= 6
            await agents[first_site].core._idle.wait()
            _, last_site = await stream_text(http, url, key, body(0, 40))
            after = await scrape(http, router)
    assert after.delta(before, BREAKS, site=first_site) == 1
    assert after.delta(before, BREAKS) == 1
    # the broken session is no longer open; a request there since opened a new one
    assert after.get(OPEN, site=first_site) == (1 if last_site == first_site else 0)
    assert after.delta(before, PER_REQUEST) == 0


async def test_requests_to_an_agent_without_the_session_rpc_are_counted_per_request(cluster, make_router, http):
    agent = await cluster.add_site("fra", 50.1, 8.7)
    key = await cluster.create_key()
    router, url = await make_router(metrics_listen="127.0.0.1:0")
    off_router, off_url = await make_router(metrics_listen="127.0.0.1:0", agent_sessions=False)
    request = {"model": FAKE_MODEL, "prompt": "hello", "max_tokens": 8, "temperature": 0}
    auth = {"Authorization": f"Bearer {key}"}
    before = await scrape(http, router)
    answers = await asyncio.gather(*(http.post(f"{url}/v1/completions", headers=auth, json=request)
                                     for _ in range(4)))
    answers.append(await http.post(f"{url}/v1/completions", headers=auth, json=request))   # after the fallback
    assert [a.status_code for a in answers] == [200] * 5
    after = await scrape(http, router)
    assert len([method for method, _ in agent.calls if method == "Generate"]) == 5
    assert after.delta(before, PER_REQUEST, site="fra") == 5
    assert after.delta(before, BREAKS) == 0
    assert after.get(OPEN, site="fra") == 0

    # sessions turned off by configuration are no old agent's doing
    off_before = await scrape(http, off_router)
    assert (await http.post(f"{off_url}/v1/completions", headers=auth, json=request)).status_code == 200
    assert (await scrape(http, off_router)).delta(off_before, PER_REQUEST) == 0
