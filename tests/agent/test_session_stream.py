"""The Session RPC (node_agent.service.SessionRelay, node_agent.client.AgentSession): many requests over one
stream, on a real agent serving the tiny checkpoint. The per-request Generate/Decode calls are the
reference: the same tokens, the same status codes on the same requests, the same freeing of KV, in fewer
messages."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import aio

from node_agent.proto import agent_pb2

from .conftest import MODEL, collect, generate_request, prompt, sampling, wait_for_free_blocks

NUM_REQUESTS = 12


async def chunks_of(call) -> list[agent_pb2.TokenChunk]:
    return [chunk async for chunk in call]


async def test_concurrent_requests_over_one_session_match_per_request_streams_in_fewer_messages(
        start_agent, connect, session_client):
    agent = await start_agent()
    per_request, session = connect(agent), session_client(agent)
    requests = [generate_request(i) for i in range(NUM_REQUESTS)]
    reference = await asyncio.gather(*(chunks_of(per_request.generate(r, timeout=60)) for r in requests))
    over_session = await asyncio.gather(*(chunks_of(session.generate(r, timeout=60)) for r in requests))

    def tokens(chunks):
        return [t.token_id for c in chunks for t in c.tokens]

    assert [tokens(c) for c in over_session] == [tokens(c) for c in reference]
    assert [c[-1].finish_reason for c in over_session] == ["length"] * NUM_REQUESTS
    assert [c[-1].num_prompt_tokens for c in over_session] == [len(r.prompt_ids) for r in requests]
    assert session.sessions and session._session is not None   # every request went over the one session
    num_chunks = sum(len(c) for c in reference)                # one message each on per-request streams
    assert session._session.num_batches < num_chunks / 2


async def test_a_failing_request_gets_its_own_status_and_the_others_continue(start_agent, session_client):
    agent = await start_agent(max_num_seqs=1)
    session = session_client(agent)
    long = session.generate(generate_request(0, max_tokens=200), timeout=60)
    first = await long.read()   # running: it holds the site's one sequence slot
    bad = agent_pb2.GenerateRequest(request_id="bad", model=MODEL, prompt_ids=[10**6], sampling=sampling(4))
    unknown = agent_pb2.GenerateRequest(request_id="unknown", model="nope", prompt_ids=[1, 2], sampling=sampling(4))
    decode = agent_pb2.DecodeRequest(request_id="full", model=MODEL, prompt_ids=prompt(30), generated_ids=[11],
                                     sampling=sampling(4))
    failures = {}
    for name, call in (("bad", session.generate(bad, timeout=60)), ("unknown", session.generate(unknown, timeout=60)),
                       ("full", session.decode(decode, timeout=60))):
        with pytest.raises(aio.AioRpcError) as failure:
            await chunks_of(call)
        failures[name] = (failure.value.code(), failure.value.details())
    assert failures["bad"][0] == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in failures["bad"][1]
    assert failures["unknown"][0] == grpc.StatusCode.NOT_FOUND
    assert failures["full"][0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "decode slots are full" in failures["full"][1]
    rest = await chunks_of(long)
    assert len(first.tokens) + sum(len(c.tokens) for c in rest) == 200 and rest[-1].finish_reason == "length"
    assert await collect(session.generate(generate_request(1), timeout=60))  # the session still serves


async def test_a_site_of_the_wrong_role_and_a_draining_site_refuse_as_per_request_calls_do(start_agent, connect,
                                                                                          session_client):
    prefill_only = await start_agent("site-p", role="prefill")
    for client in (connect(prefill_only), session_client(prefill_only)):
        with pytest.raises(aio.AioRpcError) as refused:
            await chunks_of(client.generate(generate_request(0), timeout=60))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    agent = await start_agent()
    session = session_client(agent)
    running = session.generate(generate_request(1, max_tokens=60), timeout=60)
    await running.read()
    agent.core.draining = True
    with pytest.raises(aio.AioRpcError) as draining:
        await chunks_of(session.generate(generate_request(2), timeout=60))
    assert draining.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in draining.value.details()
    assert (await chunks_of(running))[-1].finish_reason == "length"   # the open one finishes


async def test_cancel_and_session_end_free_the_requests_kv(start_agent, connect, session_client):
    agent = await start_agent()
    health = connect(agent)
    total = (await health.health()).kv_blocks_total
    session = session_client(agent)
    cancelled = session.generate(generate_request(0, max_tokens=400), timeout=60)
    kept = session.generate(generate_request(1, max_tokens=30), timeout=60)
    await cancelled.read()
    assert (await health.health()).kv_blocks_free < total
    assert cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled.read()
    assert (await chunks_of(kept))[-1].finish_reason == "length"   # its neighbour on the session is untouched
    assert await wait_for_free_blocks(health, total) == total
    assert (await health.health()).num_running == 0

    left = [session.generate(generate_request(i, max_tokens=400), timeout=60) for i in (2, 3)]
    for call in left:
        await call.read()
    assert (await health.health()).num_running == 2
    await session.close()   # the router went away mid-stream
    assert await wait_for_free_blocks(health, total) == total
    assert (await health.health()).num_running == 0


async def test_decode_over_a_session_matches_the_per_request_call(start_agent, connect, session_client):
    agent = await start_agent()
    per_request, session = connect(agent), session_client(agent)
    request = agent_pb2.DecodeRequest(request_id="d", model=MODEL, prompt_ids=prompt(30), generated_ids=[11, 12],
                                      sampling=sampling(12))
    assert await collect(session.decode(request, timeout=60)) == await collect(per_request.decode(request, timeout=60))


async def test_a_request_past_its_deadline_ends_with_deadline_exceeded_and_frees_its_kv(start_agent, connect,
                                                                                       session_client):
    agent = await start_agent()
    health = connect(agent)
    total = (await health.health()).kv_blocks_total
    session = session_client(agent)
    call = session.generate(generate_request(0, max_tokens=100_000 // 100), timeout=0.3)
    with pytest.raises(aio.AioRpcError) as expired:
        await chunks_of(call)
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await wait_for_free_blocks(health, total) == total
