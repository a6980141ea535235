"""Edges of the Session RPC where one shared stream must still behave as per-request Generate/Decode calls
do: a request cancelled before its open reached the agent never runs there, a request whose tokens cannot be
written fails alone, and a request whose engine path fails in an unexpected way ends with the status the
per-request call ends with instead of never ending."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import aio

from node_agent.client import AgentClient
from node_agent.proto import agent_pb2

from node_agent import convert

from .conftest import MODEL, PEER_TOKEN, collect, generate_request, sampling, wait_for_free_blocks

LONG = 400   # tokens: a request of this length is still running when a short neighbour has finished


def raw_session(client: AgentClient) -> tuple[aio.StreamStreamCall, asyncio.Queue]:
    """A Session call driven by hand: each SessionRequest put on the queue is sent, None ends the stream."""
    outgoing: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (message := await outgoing.get()) is not None:
            yield message

    return client.stub.Session(requests(), metadata=client.metadata()), outgoing


async def test_a_cancel_in_the_same_message_as_its_open_keeps_the_request_from_running(start_agent, connect):
    """The agent reads a message's cancels before its opens: a cancel for an open of the same message
    must still reach it, or the request runs to its end for no one, holding its KV and a sequence slot."""
    agent = await start_agent()
    client = connect(agent)
    call, outgoing = raw_session(client)
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


async def test_a_stopping_agent_ends_its_idle_sessions_and_opens_no_request(start_agent, session_client):
    """An idle session (a router's, between requests) ends as soon as the agent stops, rather than holding
    the server's stop for its grace period; a request opened on a session of a stopping agent is refused
    UNAVAILABLE, as a new call to a stopping server is, so the router places it elsewhere."""
    agent = await start_agent()
    idle, busy = session_client(agent), session_client(agent)
    assert await collect(idle.generate(generate_request(0), timeout=60))   # open, now idle
    running = busy.generate(generate_request(1, max_tokens=LONG), timeout=60)
    assert (await running.read()).tokens   # open, with a request running
    idle_session, busy_session = idle._session, busy._session
    agent.servicer.stop_sessions()
    await asyncio.wait_for(idle_session._reader, 10)   # the agent ended it
    assert idle_session.ended and not busy_session.ended
    refused = busy.generate(generate_request(2), timeout=60)
    with pytest.raises(aio.AioRpcError) as error:
        await collect(refused)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "stopping" in error.value.details()
    assert len(await collect(running)) > 0   # the running one goes on to its end, as within the grace
    await asyncio.wait_for(busy_session._reader, 10)   # and its session ends after it
    assert busy_session.ended


async def test_a_writer_that_fell_behind_sends_what_it_holds_in_messages_under_the_budget(start_agent, connect,
                                                                                        monkeypatch):
    """Tokens that piled up while the session's write was stalled go out over several messages, each under the
    budget, in order, with each request's end after its last tokens, so no message nears gRPC's size limit."""
    from node_agent import service

    monkeypatch.setattr(service, "MAX_BATCH_ENTRIES", 5)
    gate = asyncio.Event()   # the session's writes wait for it: the router stopped reading for a while

    class StalledWrites:
        def __init__(self, context):
            self._context = context

        async def write(self, message):
            await gate.wait()
            await self._context.write(message)

    relay_init = service.SessionRelay.__init__
    monkeypatch.setattr(service.SessionRelay, "__init__",
                        lambda relay, servicer, context: relay_init(relay, servicer, StalledWrites(context)))
    agent = await start_agent()
    client = connect(agent)
    call, outgoing = raw_session(client)
    outgoing.put_nowait(agent_pb2.SessionRequest(open=[
        agent_pb2.SessionOpen(id=i, generate=generate_request(i, max_tokens=12), timeout_s=60) for i in (1, 2)]))
    for _ in range(400):   # both requests run to their end while nothing is written
        await asyncio.sleep(0.025)
        relays = list(agent.servicer.sessions)
        if relays and len(relays[0]._ended) == 2:
            break
    else:
        pytest.fail("the requests did not end while the session's writes were stalled")
    gate.set()
    tokens: dict[int, list[int]] = {1: [], 2: []}
    finished: list[int] = []
    async for batch in call:
        assert sum(len(item.chunk.tokens) for item in batch.items) <= 5
        for item in batch.items:
            assert item.id not in finished, "tokens after the request's end"
            tokens[item.id] += [t.token_id for t in item.chunk.tokens]
            if item.finished:
                assert not item.HasField("error")
                finished.append(item.id)
        if len(finished) == 2:
            break
    outgoing.put_nowait(None)
    call.cancel()
    per_request = AgentClient(agent.address, PEER_TOKEN)
    try:
        for i in (1, 2):
            assert tokens[i] == await collect(per_request.generate(generate_request(i, max_tokens=12), timeout=60))
    finally:
        await per_request.close()


async def test_a_burst_of_opens_goes_out_over_messages_under_the_size_budget(start_agent, session_client, monkeypatch):
    """Opens queued together (a burst of long prompts) are split across messages once they pass the budget, so
    no message nears gRPC's limit, and each request is answered as alone."""
    from node_agent import client as client_module

    monkeypatch.setattr(client_module, "SESSION_MESSAGE_BYTES", 1)   # every open in a message of its own
    sent: list[int] = []
    requests = client_module.AgentSession._requests

    async def counted(session):
        async for message in requests(session):
            sent.append(len(message.open))
            yield message

    monkeypatch.setattr(client_module.AgentSession, "_requests", counted)
    agent = await start_agent()
    session = session_client(agent)
    calls = [session.generate(generate_request(i), timeout=60) for i in range(4)]   # queued in one go
    answers = await asyncio.gather(*(collect(call) for call in calls))
    assert max(sent) == 1 and sum(sent) == 4
    per_request = AgentClient(agent.address, PEER_TOKEN)
    try:
        for i, answer in enumerate(answers):
            assert answer == await collect(per_request.generate(generate_request(i), timeout=60))
    finally:
        await per_request.close()


async def test_a_request_whose_tokens_cannot_be_written_fails_alone_and_frees_its_kv(start_agent, connect,
                                                                                    session_client, monkeypatch):
    """One request's tokens that cannot become a message (an unexpected error while building the batch) end that
    request with UNKNOWN, as a per-request call whose handler raised; its neighbours on the session go on."""
    agent = await start_agent()
    health, session = connect(agent), session_client(agent)
    total = (await health.health()).kv_blocks_total

    def unwritable(event):
        raise ValueError("a token this agent cannot write")

    neighbour = session.generate(generate_request(0, max_tokens=LONG), timeout=60)
    await neighbour.read()   # running on the session before the bad request opens
    monkeypatch.setattr(convert, "token_to_proto", unwritable)   # only tokens with logprobs take this path
    with_logprobs = agent_pb2.GenerateRequest(request_id="lp", model=MODEL, prompt_ids=[5, 6, 7],
                                              sampling=sampling(LONG, logprobs=2))
    with pytest.raises(aio.AioRpcError) as failure:
        await collect(session.generate(with_logprobs, timeout=60))
    assert failure.value.code() == grpc.StatusCode.UNKNOWN and "cannot write" in failure.value.details()
    rest = [chunk async for chunk in neighbour]
    assert rest[-1].finish_reason == "length"
    assert await collect(session.generate(generate_request(1), timeout=60))   # the session still serves
    assert await wait_for_free_blocks(health, total) == total
    assert (await health.health()).num_running == 0
