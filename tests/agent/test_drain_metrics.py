"""Drain finishes in-flight work and refuses new work; metrics are served per agent."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from grpc import aio

from node_agent.proto import agent_pb2
from tests.agent.conftest import MODEL, collect, prompt, sampling


async def test_drain_finishes_inflight_refuses_new_and_releases_leases(start_agent, connect):
    agent = await start_agent(kv_lease_ttl_s=60)
    client = connect(agent)
    leased = await client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt(20), sampling=sampling()))
    assert leased.kv_handle
    stream = client.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(30),
                                                       sampling=sampling(max_tokens=60)))
    first = await stream.read()

    response = await client.drain(deadline_s=2.0)
    assert response.draining and response.num_inflight == 1
    assert (await client.health()).status == agent_pb2.HealthResponse.DRAINING
    with pytest.raises(aio.AioRpcError) as refused:
        await collect(client.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=[1, 2], sampling=sampling())))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()

    rest = []
    while (chunk := await stream.read()) is not aio.EOF:
        rest.extend(chunk.tokens)
    assert len(first.tokens) + len(rest) == 60  # the in-flight request ran to its end
    await asyncio.wait_for(agent.wait_stopped(), 10)
    # the unfetched lease was released at the drain deadline, before the engine stopped
    assert agent.models[MODEL].engine.engine.leases == {}


async def test_metrics_endpoint_per_agent(start_agent, connect):
    a = await start_agent("site-a", metrics_listen="127.0.0.1:0")
    b = await start_agent("site-b", metrics_listen="127.0.0.1:0")
    await collect(connect(a).generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(20),
                                                               sampling=sampling(max_tokens=5))))
    async with httpx.AsyncClient() as http:
        text_a = (await http.get(f"http://127.0.0.1:{a.metrics_port}/metrics")).text
        text_b = (await http.get(f"http://127.0.0.1:{b.metrics_port}/metrics")).text
    for name in ("edgefire_agent_waiting_requests", "edgefire_agent_kv_blocks_free", "edgefire_agent_kv_blocks_used",
                 "edgefire_agent_prefix_cache_hit_tokens", "edgefire_agent_decode_tokens_per_second",
                 "edgefire_agent_kv_bytes_sent_total", "edgefire_agent_kv_bytes_received_total"):
        assert name in text_a
    assert 'edgefire_agent_ttft_seconds_count{model="tiny",rpc="generate"} 1.0' in text_a
    assert 'edgefire_agent_inter_token_seconds_count{model="tiny"} 4.0' in text_a
    assert 'edgefire_agent_ttft_seconds_count{model="tiny",rpc="generate"}' not in text_b
