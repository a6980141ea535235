"""Drain finishes in-flight work and refuses new work; metrics are served per agent."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from grpc import aio

from node_agent.proto import agent_pb2
from tests.agent.conftest import MODEL, collect, prompt, sampling
from tests.metrics_text import Samples


async def test_drain_finishes_inflight_refuses_new_and_releases_leases(start_agent, connect):
    agent = await start_agent(kv_lease_ttl_s=60)
    client = connect(agent)
    leased = await client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt(20), sampling=sampling()))
    assert leased.kv_handle
    # long enough that the drain lands while it runs, even on a loaded machine (the agent shares this loop)
    stream = client.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(30),
                                                       sampling=sampling(max_tokens=200)))
    first = await stream.read()

    response = await client.drain(deadline_s=5.0)
    assert response.draining and response.num_inflight == 1
    assert (await client.health()).status == agent_pb2.HealthResponse.DRAINING
    with pytest.raises(aio.AioRpcError) as refused:
        await collect(client.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=[1, 2], sampling=sampling())))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()

    rest = []
    while (chunk := await stream.read()) is not aio.EOF:
        rest.extend(chunk.tokens)
    assert len(first.tokens) + len(rest) == 200  # the in-flight request ran to its end
    await asyncio.wait_for(agent.wait_stopped(), 20)
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
    # The engine's step totals: the 20-token prompt was one prefill step (it sampled the first
    # token), then four decode steps of one sequence each.
    assert 'edgefire_agent_engine_steps_total{kind="prefill",model="tiny"} 1.0' in text_a
    assert 'edgefire_agent_engine_steps_total{kind="decode",model="tiny"} 4.0' in text_a
    assert 'edgefire_agent_engine_prefill_tokens_total{model="tiny"} 20.0' in text_a
    assert 'edgefire_agent_engine_decode_tokens_total{kind="decode",model="tiny"} 4.0' in text_a
    assert 'edgefire_agent_engine_decode_tokens_total{kind="prefill",model="tiny"} 0.0' in text_a
    assert 'edgefire_agent_engine_step_seconds_total{kind="prefill",model="tiny"}' in text_a


async def test_a_split_request_moves_the_agents_metrics_by_what_it_did(start_agent, connect):
    """Scraped after real traffic: a prefill on site-a, the same prompt again (a prefix-cache hit), and
    a decode on site-b pulling the first one's KV."""
    a = await start_agent("site-a", metrics_listen="127.0.0.1:0")
    b = await start_agent("site-b", metrics_listen="127.0.0.1:0")
    client_a, client_b = connect(a), connect(b)

    async def scrape(agent) -> Samples:
        async with httpx.AsyncClient() as http:
            return Samples.parse((await http.get(f"http://127.0.0.1:{agent.metrics_port}/metrics")).text)

    before_a, before_b = await scrape(a), await scrape(b)
    prompt_ids = prompt(40)
    first = await client_a.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids, sampling=sampling()))
    second = await client_a.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids, sampling=sampling()))
    await client_a.release_kv(second.kv_handle)
    await collect(client_b.decode(agent_pb2.DecodeRequest(
        model=MODEL, prompt_ids=prompt_ids, generated_ids=[first.first_token.token_id], sampling=sampling(),
        kv_source=agent_pb2.KVSource(address=a.address, kv_handle=first.kv_handle))))
    after_a, after_b = await scrape(a), await scrape(b)

    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    assert after_a.delta(before_a, "edgefire_agent_prompt_tokens_total", model=MODEL) == 80
    assert after_a.delta(before_a, "edgefire_agent_cached_prompt_tokens_total", model=MODEL) == second.num_cached_tokens
    assert after_a.get("edgefire_agent_prefix_cache_hit_ratio", model=MODEL) == pytest.approx(
        second.num_cached_tokens / 80)
    # the decode site imported the prompt's KV: it prefilled nothing, and pulled every byte from site-a
    assert after_b.delta(before_b, "edgefire_agent_prompt_tokens_total", model=MODEL) == 0
    assert after_b.delta(before_b, "edgefire_agent_kv_pull_bytes_total", peer="site-a") == first.kv_bytes
    assert after_b.delta(before_b, "edgefire_agent_kv_pulls_total", peer="site-a", transport="data_port") == 1
    assert after_b.delta(before_b, "edgefire_agent_kv_pull_seconds_total", peer="site-a") > 0
    assert after_a.delta(before_a, "edgefire_agent_kv_bytes_sent_total") == first.kv_bytes
    assert after_b.delta(before_b, "edgefire_agent_ttft_seconds_count", model=MODEL, rpc="decode") == 1
    # the decode site's first token waited for the pull: its time to first token holds the pull's time
    assert (after_b.delta(before_b, "edgefire_agent_ttft_seconds_sum", model=MODEL, rpc="decode")
            >= after_b.delta(before_b, "edgefire_agent_kv_pull_seconds_total", peer="site-a"))
    assert 0 <= after_a.get("edgefire_agent_kv_usage_ratio", model=MODEL) <= 1
