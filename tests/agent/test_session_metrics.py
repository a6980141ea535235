"""An agent's /metrics for routers' Session streams (node_agent.service.SessionRelay): sessions open, the
messages written on them and the requests opened over them move by exactly what a real session did, and
per-request calls move none of them."""

from __future__ import annotations

import asyncio

import httpx

from node_agent.proto import agent_pb2
from tests.metrics_text import Samples

from .conftest import MODEL, collect, generate_request, prompt, sampling


async def scrape(agent) -> Samples:
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.get(f"http://127.0.0.1:{agent.metrics_port}/metrics")
    assert response.status_code == 200
    return Samples.parse(response.text)


async def sessions_open_becomes(agent, expected: int) -> Samples:
    for _ in range(100):
        samples = await scrape(agent)
        if samples.get("edgefire_agent_sessions_open") == expected:
            return samples
        await asyncio.sleep(0.05)
    raise AssertionError(f"edgefire_agent_sessions_open stayed {samples.get('edgefire_agent_sessions_open')}, "
                         f"not {expected}")


async def test_session_counters_move_by_what_one_session_carried(start_agent, connect, session_client):
    agent = await start_agent(metrics_listen="127.0.0.1:0")
    before = await scrape(agent)
    assert before.get("edgefire_agent_sessions_open") == 0

    session = session_client(agent)
    generated = await asyncio.gather(*(collect(session.generate(generate_request(i), timeout=60)) for i in range(5)))
    decode = agent_pb2.DecodeRequest(request_id="d", model=MODEL, prompt_ids=prompt(30), generated_ids=[11, 12],
                                     sampling=sampling(12))
    decoded = await collect(session.decode(decode, timeout=60))
    assert [len(tokens) for tokens in generated] == [10] * 5
    assert len(decoded) == 10   # max_tokens counts its two generated ids
    during = await scrape(agent)
    assert during.get("edgefire_agent_sessions_open") == 1
    assert during.delta(before, "edgefire_agent_session_requests_total", rpc="generate") == 5
    assert during.delta(before, "edgefire_agent_session_requests_total", rpc="decode") == 1
    # every message the agent wrote is one the router's side read
    num_messages = session._session.num_batches
    assert during.delta(before, "edgefire_agent_session_messages_total") == num_messages
    # the engine's decoded tokens over the session's messages: several tokens per message
    num_tokens = during.delta(before, "edgefire_agent_engine_decode_tokens_total")
    assert num_tokens / num_messages > 1

    # per-request calls are no session's
    per_request = connect(agent)
    assert len(await collect(per_request.generate(generate_request(9), timeout=60))) == 10
    after_per_request = await scrape(agent)
    for name in ("edgefire_agent_session_requests_total", "edgefire_agent_session_messages_total"):
        assert after_per_request.delta(during, name) == 0, name

    # the router's side goes away mid-stream: its session is no longer open
    running = session.generate(generate_request(10, max_tokens=400), timeout=60)
    await running.read()
    await session.close()
    ended = await sessions_open_becomes(agent, 0)
    assert ended.delta(during, "edgefire_agent_session_requests_total", rpc="generate") == 1
