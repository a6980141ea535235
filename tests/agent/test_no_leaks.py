"""Every path frees its KV blocks: completed, cancelled, timed out, expired, released, failed."""

from __future__ import annotations

import asyncio
import random

from grpc import aio

from node_agent.proto import agent_pb2
from tests.agent.conftest import MODEL, collect, prompt, sampling, wait_for_free_blocks


async def test_blocks_return_after_mixed_traffic(start_agent, connect):
    a = await start_agent("site-a", kv_lease_ttl_s=0.5)
    b = await start_agent("site-b", kv_lease_ttl_s=0.5)
    client_a, client_b = connect(a), connect(b)
    free_a, free_b = (await client_a.health()).kv_blocks_free, (await client_b.health()).kv_blocks_free
    rng = random.Random(0)

    def prompt_ids() -> list[int]:
        return prompt(rng.randint(8, 90), start=rng.randint(0, 400))

    async def generate_done():
        await collect(client_a.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt_ids(),
                                                                  sampling=sampling(max_tokens=8))))

    async def generate_cancelled():
        call = client_b.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt_ids(),
                                                           sampling=sampling(max_tokens=500)))
        await call.read()
        await call.read()
        call.cancel()

    async def generate_deadline():
        call = client_a.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt_ids(),
                                                           sampling=sampling(max_tokens=1000)), timeout=0.15)
        try:
            await collect(call)
        except aio.AioRpcError:
            pass  # DEADLINE_EXCEEDED is the point of this request

    async def prefill(sampling_params=None):
        return await client_a.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids(),
                                                               sampling=sampling_params or sampling()))

    async def prefill_expired():
        await prefill()  # never fetched: the lease expires

    async def prefill_released():
        assert await client_a.release_kv((await prefill()).kv_handle)

    async def decode(cancel: bool = False, bad_handle: bool = False):
        ids = prompt_ids()
        result = await client_a.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=ids, sampling=sampling()))
        source = agent_pb2.KVSource(address=a.address, kv_handle="tiny/00" if bad_handle else result.kv_handle)
        call = client_b.decode(agent_pb2.DecodeRequest(model=MODEL, prompt_ids=ids, sampling=sampling(max_tokens=300),
                                                       generated_ids=[result.first_token.token_id], kv_source=source))
        if cancel:
            await call.read()
            call.cancel()
        else:
            await collect(call)

    async def bad_request():
        try:
            await collect(client_b.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=[1, 9999])))
        except aio.AioRpcError:
            pass  # INVALID_ARGUMENT, tested elsewhere

    kinds = [generate_done, generate_cancelled, generate_deadline, prefill_expired, prefill_released,
             lambda: decode(), lambda: decode(cancel=True), lambda: decode(bad_handle=True), bad_request]
    for _round in range(3):
        await asyncio.gather(*(kind() for kind in kinds for _ in range(2)))

    assert await wait_for_free_blocks(client_a, free_a) == free_a
    assert await wait_for_free_blocks(client_b, free_b) == free_b
    for agent in (a, b):
        assert agent.core.num_inflight == 0
        stats = await agent.models[MODEL].engine.stats()
        assert stats.num_running == stats.num_waiting == stats.num_pinned_handles == 0


async def test_a_prefill_cancelled_while_it_runs_leaves_no_lease(start_agent, connect):
    """A caller that cancels its Prefill (a client gone, a router's deadline) while the prefill step runs
    never learns the KV handle: its lease must end at once, not hold its blocks until the TTL."""
    import threading

    a = await start_agent("site-a", kv_lease_ttl_s=300)
    client = connect(a)
    free = (await client.health()).kv_blocks_free
    engine = a.models[MODEL].engine.engine
    stepping, proceed = threading.Event(), threading.Event()
    step = engine.step

    def gated_step():
        stepping.set()
        proceed.wait(10)
        return step()

    engine.step = gated_step
    call = asyncio.ensure_future(client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt(60),
                                                                         sampling=sampling())))
    await asyncio.to_thread(stepping.wait, 10)  # the prefill's step has begun
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    while a.core.num_inflight:  # the agent has seen the cancellation and left the engine's stream
        await asyncio.sleep(0.01)
    proceed.set()  # the step completes and pins the prompt's KV for a caller that is gone

    assert await wait_for_free_blocks(client, free) == free
    assert (await client.health()).num_kv_leases == 0
