"""Admission's count of waiting requests while the engine thread takes a burst: each request counted once."""

from __future__ import annotations

import asyncio
import threading

from node_agent.client import AgentClient
from node_agent.proto import agent_pb2

from .conftest import MODEL, PEER_TOKEN, collect, prompt, sampling

BURST = 8


async def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_requests_the_engine_thread_is_adding_are_counted_once(start_agent):
    """A burst no larger than the queue is never refused. The agent of a relay benchmark refused a round of
    256 requests against a limit of 257 with "367 waiting": while the engine thread added a burst one request
    at a time, each one it had added was in the refreshed stats and still among the pending admissions."""
    agent = await start_agent(max_waiting=BURST + 1, max_num_seqs=BURST + 1)
    engine = agent.models[MODEL].engine
    adding, resume, hold = threading.Event(), threading.Event(), threading.Event()
    add_request, num_added = engine.engine.add_request, 0

    def add_and_pause(*args, **kwargs):
        nonlocal num_added
        num_added += 1
        if num_added == BURST // 2:  # the first half's last add; the ones before it were added and counted
            adding.set()
            resume.wait(30)
        return add_request(*args, **kwargs)

    engine.engine.add_request = add_and_pause
    client = AgentClient(agent.address, PEER_TOKEN, sessions=True)

    def send(index: int) -> asyncio.Future:
        return asyncio.ensure_future(collect(client.generate(agent_pb2.GenerateRequest(
            request_id=f"r{index}", model=MODEL, prompt_ids=prompt(20, start=index), sampling=sampling(4)))))

    busy = asyncio.ensure_future(engine.call(lambda _engine: hold.wait(30)))  # the first half's adds in one go
    try:
        calls = [send(i) for i in range(BURST // 2)]
        await wait_until(lambda: engine.admission_figures()[1] == BURST // 2)
        hold.set()
        await busy
        await asyncio.to_thread(adding.wait, 10)
        pending_before = engine.admission_figures()[1]
        calls += [send(i) for i in range(BURST // 2, BURST)]  # admitted while the engine thread is mid-burst
        await wait_until(lambda: engine.admission_figures()[1] - pending_before
                         + sum(call.done() for call in calls) == BURST // 2)
    finally:
        hold.set()
        resume.set()
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    await client.close()
    refused = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    assert not refused, [f"{error.code()}: {error.details()}" for error in refused]
    assert all(len(tokens) == 4 for tokens in outcomes)
