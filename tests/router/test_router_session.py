"""The router's requests to an agent over one Session stream (node_agent.client.AgentSession): the same
answers as per-request streams, a broken session resumed elsewhere as a broken stream is, a client's
hang-up freeing its KV on the agent, and agents without the RPC (fake agents here) served per request.

Real in-process agents serve the tiny checkpoint behind one router, as in test_resume_stateful_streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from types import SimpleNamespace

import httpx
from router_fake_agent import MODEL as FAKE_MODEL

from node_agent.config import AgentConfig
from node_agent.daemon import Agent
from node_agent.service import SessionRelay

MODEL = "tiny-real"
PEER_TOKEN = "peer-secret"
SITES = {"oslo": (59.9, 10.7), "bergen": (60.4, 5.3)}


@contextlib.asynccontextmanager
async def sites(cluster, make_router, model_dir, **router_settings):
    """(router, url, key, agents by name): real agents at SITES, both roles, behind one router."""
    agents: dict[str, Agent] = {}
    try:
        for name, (lat, lon) in SITES.items():
            agent = Agent(AgentConfig(site=name, models={MODEL: str(model_dir)}, grpc_listen="127.0.0.1:0",
                                      metrics_listen=None, peer_token=PEER_TOKEN, kv_cache_bytes=8 << 20,
                                      device="cpu", dtype="float32"))
            await agent.start()
            agents[name] = agent
            await cluster.admin.create_site(name, region="eu", country="NO", lat=lat, lon=lon,
                                            grpc_address=agent.address, models=[{"model": MODEL, "role": "both"}],
                                            heartbeat_interval_s=60)
            await cluster.heartbeat(name)
        key = await cluster.create_key()
        router, url = await make_router(peer_token=PEER_TOKEN, first_token_timeout_s=60, token_idle_timeout_s=60,
                                        cooldown_s=0.0, allow_split=False, **router_settings)
        yield router, url, key, agents
    finally:
        for agent in agents.values():
            await agent.stop()


def body(index: int, max_tokens: int = 24) -> dict:
    return {"model": MODEL, "prompt": f"edge site number {index} says", "max_tokens": max_tokens, "temperature": 0,
            "stream": True}


async def stream_text(http: httpx.AsyncClient, url: str, key: str, request: dict) -> tuple[str, str]:
    """(text, decode site) of a streamed completion."""
    text = ""
    async with http.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                           json=request) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                text += "".join(choice["text"] for choice in event["choices"])
    return text, response.headers["x-edgefire-decode-site"]


async def test_concurrent_streams_over_sessions_match_per_request_streams(cluster, make_router, tiny_model_dir):
    num_requests = 10
    async with sites(cluster, make_router, tiny_model_dir) as (router, url, key, agents):
        _, off_url = await make_router(peer_token=PEER_TOKEN, first_token_timeout_s=60, token_idle_timeout_s=60,
                                       allow_split=False, agent_sessions=False)
        async with httpx.AsyncClient(timeout=120) as http:
            reference = await asyncio.gather(*(stream_text(http, off_url, key, body(i)) for i in range(num_requests)))
            over_sessions = await asyncio.gather(*(stream_text(http, url, key, body(i))
                                                   for i in range(num_requests)))
        assert [text for text, _ in over_sessions] == [text for text, _ in reference]
        used = {site for _, site in over_sessions}
        clients = [router.agents.client(agents[site].address) for site in used]
        assert all(client.sessions and client._session is not None for client in clients)
        # one message per engine step for all of a router's requests on a site, not one per request and step
        num_batches = sum(client._session.num_batches for client in clients)
        assert num_batches < num_requests * 24 / 2


@contextlib.contextmanager
def broken_session(servicer, at: int):
    """Within: the Session of `servicer`'s agent breaks (its connection reset) as it builds its `at`-th batch
    with requests open; the yielded object's `num_batches` counts those batches."""
    batch = SessionRelay._batch
    counter = SimpleNamespace(num_batches=0)

    def breaking_batch(relay):
        if relay._servicer is servicer and relay._tasks:
            counter.num_batches += 1
            if counter.num_batches == at:
                raise ConnectionResetError("the session's connection broke")
        return batch(relay)

    SessionRelay._batch = breaking_batch
    try:
        yield counter
    finally:
        SessionRelay._batch = batch


async def test_a_session_broken_mid_stream_resumes_its_requests_elsewhere(cluster, make_router, tiny_model_dir,
                                                                          caplog):
    async with sites(cluster, make_router, tiny_model_dir) as (router, url, key, agents):
        async with httpx.AsyncClient(timeout=120) as http:
            reference = await asyncio.gather(*(stream_text(http, url, key, body(i, 40)) for i in range(3)))
            first_site = reference[0][1]
            old_session = router.agents.client(agents[first_site].address)._session
            caplog.clear()
            # at its sixth batch, tokens have reached the clients: a resume, not a fresh start
            with caplog.at_level(logging.WARNING), broken_session(agents[first_site].servicer, 6) as broken:
                resumed = await asyncio.gather(*(stream_text(http, url, key, body(i, 40)) for i in range(3)))
            assert broken.num_batches >= 6
            assert [text for text, _ in resumed] == [text for text, _ in reference]
            assert f"site {first_site} failed (unknown) after" in caplog.text
            assert "after 0 token(s)" not in caplog.text
            assert router.metrics.resumes.labels("unknown")._value.get() >= 1
            # the broken session's requests were cancelled on its agent; the next request opens a new session
            await agents[first_site].core._idle.wait()
            assert (await stream_text(http, url, key, body(0, 40)))[0] == reference[0][0]
            assert router.agents.client(agents[first_site].address)._session is not old_session


async def test_a_client_hang_up_cancels_its_request_and_frees_its_kv(cluster, make_router, tiny_model_dir):
    async with sites(cluster, make_router, tiny_model_dir) as (router, url, key, agents):
        async with httpx.AsyncClient(timeout=120) as http:
            async with http.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                   json=body(0, 600)) as response:
                site = agents[response.headers["x-edgefire-decode-site"]]
                total = (await site.servicer.Health(None, None)).kv_blocks_total
                lines = response.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass
                assert (await site.servicer.Health(None, None)).num_running == 1
            session = router.agents.client(site.address)._session
            for _ in range(200):
                health = await site.servicer.Health(None, None)
                if health.num_running == 0 and health.kv_blocks_free == total:
                    break
                await asyncio.sleep(0.05)
            assert (health.num_running, health.kv_blocks_free) == (0, total)
            assert not session.ended   # only the request ended; its session serves the next one
            await stream_text(http, url, key, body(1))
            assert router.agents.client(site.address)._session is session


async def test_an_agent_without_the_session_rpc_is_served_per_request(cluster, make_router, http):
    agent = await cluster.add_site("fra", 50.1, 8.7)
    key = await cluster.create_key()
    router, url = await make_router()
    request = {"model": FAKE_MODEL, "prompt": "hello", "max_tokens": 8, "temperature": 0}
    answers = await asyncio.gather(*(http.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                               json=request) for _ in range(4)))
    assert [a.status_code for a in answers] == [200] * 4
    assert len({a.json()["choices"][0]["text"] for a in answers}) == 1
    assert [method for method, _ in agent.calls if method == "Generate"] == ["Generate"] * 4
    client = router.agents.client(agent.address)
    assert not client.sessions and client._session is None
    assert (await http.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                            json=request)).status_code == 200


async def test_sessions_can_be_turned_off(cluster, make_router, tiny_model_dir):
    async with sites(cluster, make_router, tiny_model_dir, agent_sessions=False) as (router, url, key, agents):
        async with httpx.AsyncClient(timeout=120) as http:
            _, site = await stream_text(http, url, key, body(0))
        client = router.agents.client(agents[site].address)
        assert not client.sessions and client._session is None
