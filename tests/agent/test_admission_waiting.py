"""Admission counts the KV blocks the engine's waiting requests will take: a queued request takes its blocks only
when the scheduler runs it, so until then they are free in the stats, yet no new request can have them."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

import grpc
from grpc import aio

from node_agent.proto import agent_pb2
from tests.agent.conftest import MODEL, collect, prompt, sampling, wait_for_free_blocks


async def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@contextmanager
def held_steps(engine):
    """The engine thread runs a step only for each permit released on the yielded semaphore (without one, its step
    does nothing, so it still adds the requests handed to it): they are in its stats, waiting, and not scheduled.
    Every step runs freely again on leaving."""
    step, permits = engine.engine.step, threading.Semaphore(0)

    def gated():
        return step() if permits.acquire(timeout=0.01) else []

    engine.engine.step = gated
    try:
        yield permits
    finally:
        engine.engine.step = step
        permits.release(1000)


def generate(client, ids: list[int]) -> asyncio.Future:
    return asyncio.ensure_future(collect(client.generate(agent_pb2.GenerateRequest(
        model=MODEL, prompt_ids=ids, sampling=sampling(max_tokens=2)))))


async def counted_waiting(engine, num_waiting: int) -> None:
    """Until the engine's stats count num_waiting queued requests and no admission is pending any more."""
    await wait_until(lambda: engine.latest_stats.num_waiting == num_waiting
                     and engine.admission_figures().num_pending == 0)


async def refusal(engine, call: asyncio.Future, num_waiting: int) -> str:
    """The details of the call's RESOURCE_EXHAUSTED, once answered; an assertion error if the agent admitted it
    instead (on the blocks the num_waiting queued requests will take)."""
    await wait_until(lambda: call.done() or engine.admission_figures().num_pending
                     or engine.latest_stats.num_waiting > num_waiting)
    assert call.done(), "the request was admitted on the blocks the queued ones will take"
    error = call.exception()
    assert isinstance(error, aio.AioRpcError) and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    return error.details()


async def test_a_long_prompt_is_refused_while_a_queued_one_holds_the_free_blocks(start_agent, connect):
    """Two 100-token prompts, 7 blocks each with the first token, at a site with 12 free: while the first waits in
    the engine's queue, the second is refused (the router sends it to a site with room), not admitted on the
    same free blocks to wait behind it. The stats count the queued one's 7 blocks until it runs, then none."""
    agent = await start_agent(kv_cache_bytes=12 * 8192)   # 12 blocks of 16 tokens
    client, engine = connect(agent), agent.models[MODEL].engine
    with held_steps(engine) as permits:
        first = generate(client, prompt(100))
        await counted_waiting(engine, 1)
        assert (engine.latest_stats.num_blocks_free, engine.latest_stats.num_blocks_waiting) == (12, 7)
        details = await refusal(engine, generate(client, prompt(100, start=2)), 1)
        assert "KV pool is full: the request needs 7 blocks, 4 of 12 are free for it" in details
        assert "queued requests will take 7" in details
        permits.release()   # one step: the first is scheduled, takes its blocks and prefills
        await wait_until(lambda: engine.latest_stats.num_running == 1)
        assert (engine.latest_stats.num_waiting, engine.latest_stats.num_blocks_waiting) == (0, 0)
        assert engine.latest_stats.num_blocks_free == 12 - 7
    assert len(await first) == 2
    assert await wait_for_free_blocks(client, 12) == 12
    assert len(await generate(client, prompt(100, start=2))) == 2   # served once the first is done


async def test_a_queued_request_sharing_a_held_prefix_counts_its_uncached_blocks(start_agent, connect):
    """A KV lease holds a 100-token system prompt (7 blocks, 6 full); 9 of 16 blocks are free. A 136-token request on
    that prompt waits in the queue counting the 3 blocks it does not share, not its 9: a 70-token request (5 blocks)
    still fits beside it and the engine's watermark; a third no longer does."""
    agent = await start_agent(kv_cache_bytes=16 * 8192, kv_lease_ttl_s=60)   # 16 blocks of 16 tokens
    client, engine = connect(agent), agent.models[MODEL].engine
    system = prompt(100)
    leased = await client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=system, sampling=sampling()))
    assert (await client.health()).kv_blocks_free == 9
    with held_steps(engine):
        shares = generate(client, system[:96] + prompt(40, start=50))
        await counted_waiting(engine, 1)
        assert engine.latest_stats.num_blocks_waiting == 3
        fits = generate(client, prompt(70, start=3))
        await counted_waiting(engine, 2)
        assert engine.latest_stats.num_blocks_waiting == 3 + 5
        assert "KV pool is full" in await refusal(engine, generate(client, prompt(20, start=4)), 2)
    assert [len(await shares), len(await fits)] == [2, 2]
    assert await client.release_kv(leased.kv_handle)
    assert await wait_for_free_blocks(client, 16) == 16
