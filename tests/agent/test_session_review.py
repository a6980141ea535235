"""Edges of the Session RPC where one shared stream must still behave as per-request Generate/Decode calls
do: a request cancelled before its open reached the agent never runs there, and a request whose engine path
fails in an unexpected way ends with the status the per-request call ends with instead of never ending."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import aio

from node_agent.client import AgentClient
from node_agent.proto import agent_pb2

from .conftest import MODEL, PEER_TOKEN, collect, prompt, sampling

LONG = 400   # tokens: a request of this length is still running when a short neighbour has finished


def generate_request(index: int, max_tokens: int = 10) -> agent_pb2.GenerateRequest:
    return agent_pb2.GenerateRequest(request_id=f"r{index}", model=MODEL, prompt_ids=prompt(20 + index, start=index),
                                     sampling=sampling(max_tokens))


@pytest.fixture
async def session_client():
    clients: list[AgentClient] = []

    def make(agent) -> AgentClient:
        client = AgentClient(agent.address, PEER_TOKEN, sessions=True)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


async def test_a_cancel_in_the_same_message_as_its_open_keeps_the_request_from_running(start_agent, connect):
    """The agent reads a message's cancels before its opens: a cancel for an open of the same message
    must still reach it, or the request runs to its end for no one, holding its KV and a sequence slot."""
    agent = await start_agent()
    client = connect(agent)
    outgoing: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (message := await outgoing.get()) is not None:
            yield message

    call = client.stub.Session(requests(), metadata=client.metadata())
    outgoing.put_nowait(agent_pb2.SessionRequest(
        open=[agent_pb2.SessionOpen(id=1, generate=generate_request(0, max_tokens=LONG), timeout_s=60)], cancel=[1]))
    outgoing.put_nowait(agent_pb2.SessionRequest(
        open=[agent_pb2.SessionOpen(id=2, generate=generate_request(1), timeout_s=60)]))
    seen: set[int] = set()
    async for batch in call:
        seen.update(item.id for item in batch.items)
        if any(item.id == 2 and item.finished for item in batch.items):
            break
    running = (await client.health()).num_running
    outgoing.put_nowait(None)
    call.cancel()
    assert seen == {2}, "the agent streamed a request that was cancelled in the message that opened it"
    assert running == 0


async def test_a_request_cancelled_before_its_open_went_out_never_runs_on_the_agent(start_agent, connect,
                                                                                   session_client):
    agent = await start_agent()
    health, session = connect(agent), session_client(agent)
    assert await collect(session.generate(generate_request(0), timeout=60))   # the session is open and idle
    cancelled = session.generate(generate_request(1, max_tokens=LONG), timeout=60)
    assert cancelled.cancel()   # its client left at once: the open and the cancel go out together
    with pytest.raises(asyncio.CancelledError):
        await cancelled.read()
    assert await collect(session.generate(generate_request(2), timeout=60))   # sent after both: they were read
    assert (await health.health()).num_running == 0
    assert agent.core.num_inflight == 0


async def test_a_stray_timeout_in_a_request_ends_it_with_unknown_as_the_per_request_call_does(
        start_agent, connect, session_client):
    """A TimeoutError that is not the request's deadline (a library timing out inside the engine path)."""
    agent = await start_agent()
    per_request, session = connect(agent), session_client(agent)

    async def failing(request, request_id):
        raise TimeoutError("a library's own timeout")
        yield  # an async generator

    agent.servicer.generate_events = failing
    codes = []
    for client in (per_request, session):
        with pytest.raises(aio.AioRpcError) as failure:
            # the guard only bounds a hang; the answer comes at once
            await asyncio.wait_for(collect(client.generate(generate_request(0), timeout=120)), 30)
        codes.append(failure.value.code())
    assert codes == [grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNKNOWN]
    del agent.servicer.generate_events
    assert await collect(session.generate(generate_request(1), timeout=60))   # the session still serves


def accepted_calls(agent) -> float:
    return sum(sample.value for metric in agent.metrics.accepted_calls.collect() for sample in metric.samples
               if sample.name.endswith("_total"))


async def test_requests_over_a_session_are_counted_as_accepted_calls_as_per_request_calls_are(
        start_agent, connect, session_client):
    """The count an operator watches to know a token is no longer presented (deploy/README.md, Tokens):
    a router that keeps using an old token over one long-lived session must keep it growing."""
    agent = await start_agent()
    per_request, session = connect(agent), session_client(agent)
    num_requests = 4
    grown = []
    for client in (per_request, session):
        before = accepted_calls(agent)
        for index in range(num_requests):
            assert await collect(client.generate(generate_request(index), timeout=60))
        grown.append(accepted_calls(agent) - before)
    assert grown[0] == num_requests
    assert grown[1] >= num_requests   # each request it opened, besides the session's own call
