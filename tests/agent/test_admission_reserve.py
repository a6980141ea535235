"""Admission reserves the KV blocks it admitted a request on, from the check until the engine's stats count the
request: decodes pulling their KV hold their blocks, a shared prefix is credited to each request of a burst, and
every exit gives the reservation back."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from grpc import aio

from engine.errors import InvalidRequestError, KVTransferError
from engine.sampling import SamplingParams
from node_agent.proto import agent_pb2
from tests.agent.conftest import MODEL, collect, prompt, sampling, wait_for_free_blocks

# blocks of 16 tokens (kv_cache_bytes below); a decode of a 20-token prompt needs 2, and an import leaves the
# engine's watermark (1 block) free: room for 4
POOL = 9


async def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def hold_pulls(agent) -> tuple[list, asyncio.Event]:
    """The decode agent's KV pulls wait for the event (a slow transfer of a long prompt); the list counts them."""
    pull, entered, release = agent.core._pull, [], asyncio.Event()

    async def held_pull(*args, **kwargs):
        entered.append(args)
        await release.wait()
        return await pull(*args, **kwargs)

    agent.core._pull = held_pull
    return entered, release


async def refusal(call) -> str:
    """The details of a RESOURCE_EXHAUSTED answer to the call."""
    try:
        await collect(call)
    except aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        return exc.details()
    raise AssertionError("the request was served")


async def test_decodes_pulling_their_kv_hold_their_blocks(start_agent, connect):
    """A burst of decodes whose KV pulls take a while, at a site with room for 4: the fifth is refused at once (the
    router tries another site), rather than admitted against the blocks the four will take and left to wait."""
    a, b = await start_agent("site-a"), await start_agent("site-b", kv_cache_bytes=POOL * 8192)
    client_a, client_b = connect(a), connect(b)
    params = sampling(max_tokens=4)
    prompts = [prompt(20, start=i) for i in range(5)]
    references = [await collect(client_a.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=ids,
                                                                             sampling=params))) for ids in prompts]
    leases = [await client_a.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=ids, sampling=params))
              for ids in prompts]
    entered, release = hold_pulls(b)

    def decode(ids, lease) -> asyncio.Future:
        return asyncio.ensure_future(collect(client_b.decode(agent_pb2.DecodeRequest(
            model=MODEL, prompt_ids=ids, generated_ids=[lease.first_token.token_id], sampling=params,
            kv_source=agent_pb2.KVSource(address=a.address, kv_handle=lease.kv_handle)))))

    calls = [decode(ids, lease) for ids, lease in zip(prompts, leases)]
    try:
        await wait_until(lambda: len(entered) + sum(call.done() for call in calls) == len(calls))
        refused = [i for i, call in enumerate(calls) if call.done()]
        assert len(entered) == 4 and len(refused) == 1
        error = calls[refused[0]].exception()
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV pool is full" in error.details()
    finally:
        release.set()
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    for i, (lease, outcome) in enumerate(zip(leases, outcomes)):
        if i in refused:
            assert await client_a.release_kv(lease.kv_handle)   # the router ends the lease it did not use
        else:
            assert [lease.first_token.token_id, *outcome] == references[i]
    assert b.metrics.kv_fallbacks._value.get() == 0
    assert b.models[MODEL].engine.admission_figures().num_pending_blocks == 0
    assert await wait_for_free_blocks(client_b, POOL) == POOL


async def test_a_burst_sharing_a_held_prefix_is_credited_for_each(start_agent, connect):
    """A burst of requests that share a long system prompt a lease holds, arriving within one step: each needs one
    block past the prefix, and 6 are free, one of them the engine's watermark. All 5 are admitted (the second was
    refused when the first counted its whole prompt while the engine took it), and a sixth is still refused."""
    agent = await start_agent(kv_cache_bytes=13 * 8192, kv_lease_ttl_s=60)   # 13 blocks of 16 tokens
    client = connect(agent)
    engine = agent.models[MODEL].engine
    system = prompt(100)
    leased = await client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=system, sampling=sampling()))
    assert (await client.health()).kv_blocks_free == 6    # the lease holds 7 blocks, 6 of them full
    prompts = [system[:96] + prompt(4, start=20 + i) for i in range(6)]   # 7 blocks, 6 of them the lease's
    hold = threading.Event()
    busy = asyncio.ensure_future(engine.call(lambda _engine: hold.wait(30)))  # a step that does not end yet
    calls = [asyncio.ensure_future(collect(client.generate(agent_pb2.GenerateRequest(
        model=MODEL, prompt_ids=ids, sampling=sampling(max_tokens=2))))) for ids in prompts]
    try:
        await wait_until(lambda: engine.admission_figures().num_pending + sum(c.done() for c in calls) == len(calls))
        refused = [call for call in calls if call.done()]
        assert len(refused) == 1, [call.exception().details() for call in refused]
        assert "KV pool is full" in refused[0].exception().details()
        assert engine.admission_figures().num_pending_blocks == 5
    finally:
        hold.set()
        await busy
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    for ids, outcome in zip(prompts, outcomes):
        if isinstance(outcome, list):
            assert outcome == await collect(client.generate(agent_pb2.GenerateRequest(
                model=MODEL, prompt_ids=ids, sampling=sampling(max_tokens=2))))
    assert await client.release_kv(leased.kv_handle)
    assert engine.admission_figures().num_pending_blocks == 0
    assert await wait_for_free_blocks(client, 13) == 13


async def test_every_exit_gives_the_reservation_back(start_agent, connect):
    """While a decode pulls its KV, a request that needs the whole pool is refused; once the decode is served (on
    the pulled KV, after a failed pull, after a refused import) or cancelled (in its pull, or waiting for the engine
    to take it), the blocks are free again and that request is served. Generate and Prefill give theirs back too."""
    a, b = await start_agent("site-a"), await start_agent("site-b", kv_cache_bytes=POOL * 8192)
    client_a, client_b = connect(a), connect(b)
    engine_a, engine_b = a.models[MODEL].engine, b.models[MODEL].engine
    params = sampling(max_tokens=4)
    whole_pool = agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(POOL * 16 - 1, start=3),
                                           sampling=sampling(max_tokens=1))
    entered, release = hold_pulls(b)
    import_kv = engine_b.engine.import_kv

    def refused_import(*args, **kwargs):
        raise KVTransferError("layout mismatch (test)")

    async def decode(index: int, outcome: str) -> None:
        ids = prompt(20, start=index)
        reference = await collect(client_a.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=ids,
                                                                               sampling=params)))
        lease = await client_a.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=ids, sampling=params))
        handle = f"{MODEL}/deadbeef" if outcome == "failed pull" else lease.kv_handle
        entered.clear()
        release.clear()
        call = asyncio.ensure_future(collect(client_b.decode(agent_pb2.DecodeRequest(
            model=MODEL, prompt_ids=ids, generated_ids=[lease.first_token.token_id], sampling=params,
            kv_source=agent_pb2.KVSource(address=a.address, kv_handle=handle)))))
        await wait_until(lambda: entered)
        assert "KV pool is full" in await refusal(client_b.generate(whole_pool)), outcome
        engine_b.engine.import_kv = refused_import if outcome == "refused import" else import_kv
        if outcome == "cancelled in its pull":
            call.cancel()
        elif outcome == "cancelled waiting for the engine":
            hold = threading.Event()
            busy = asyncio.ensure_future(engine_b.call(lambda _engine: hold.wait(30)))
            release.set()
            await wait_until(lambda: engine_b.admission_figures().num_pending == 1)   # handed to the engine thread
            call.cancel()
            await wait_until(lambda: not b.core.num_inflight)   # the agent saw the cancellation before the add ran
            hold.set()
            await busy
        else:
            release.set()
            assert [lease.first_token.token_id, *await call] == reference, outcome
        await asyncio.gather(call, return_exceptions=True)
        engine_b.engine.import_kv = import_kv
        if outcome != "success":
            await client_a.release_kv(lease.kv_handle)
        await wait_until(lambda: engine_b.admission_figures().num_pending_blocks == 0)
        assert await wait_for_free_blocks(client_b, POOL) == POOL, outcome
        assert len(await collect(client_b.generate(whole_pool))) == 1, outcome

    outcomes = ["success", "failed pull", "refused import", "cancelled in its pull", "cancelled waiting for the engine"]
    for index, outcome in enumerate(outcomes):
        await decode(index, outcome)
    assert b.metrics.kv_fallbacks._value.get() == 2   # the failed pull and the refused import recomputed

    add_request = engine_a.engine.add_request

    def refused_add(*args, **kwargs):
        raise InvalidRequestError("refused by the engine (test)")

    engine_a.engine.add_request = refused_add
    try:
        for rpc, kind in ((client_a.generate, agent_pb2.GenerateRequest), (client_a.prefill, agent_pb2.PrefillRequest)):
            with pytest.raises(aio.AioRpcError) as info:
                result = rpc(kind(model=MODEL, prompt_ids=prompt(30), sampling=params))
                await (collect(result) if hasattr(result, "__aiter__") else result)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    finally:
        engine_a.engine.add_request = add_request
    figures = engine_a.admission_figures()
    assert (figures.num_pending, figures.num_pending_blocks, figures.num_reserved) == (0, 0, 0)
    assert len(await collect(client_a.generate(agent_pb2.GenerateRequest(
        model=MODEL, prompt_ids=prompt(30), sampling=params)))) == 4
    assert engine_a.admission_figures().num_pending_blocks == 0


async def test_a_prefill_cancelled_before_it_heard_its_start_ends_its_lease(start_agent, connect):
    """A Prefill whose caller leaves after the engine ran it but before the agent read the answer to its start (the
    event loop busy meanwhile): its lease, whose handle no one will learn, ends at once rather than at its TTL."""
    agent = await start_agent()
    client, engine = connect(agent), agent.models[MODEL].engine
    total = (await client.health()).kv_blocks_free
    dispatch, dispatched = engine._dispatch, threading.Event()

    def watched(outputs) -> None:
        dispatch(outputs)
        if any(out.kv_handle for out in outputs):
            dispatched.set()

    engine._dispatch = watched
    task = asyncio.ensure_future(agent.core.prefill(MODEL, prompt(20), SamplingParams(max_tokens=4, ignore_eos=True)))
    await asyncio.sleep(0)           # admitted, and waiting for the engine thread's add
    assert dispatched.wait(30)       # the loop is held: the add's answer and the first token wait behind this
    task.cancel()
    assert (await asyncio.gather(task, return_exceptions=True))[0].__class__ is asyncio.CancelledError
    assert await wait_for_free_blocks(client, total) == total
    figures = engine.admission_figures()
    assert (figures.num_pending, figures.num_pending_blocks, figures.num_reserved) == (0, 0, 0)


async def test_an_import_failing_in_its_kv_write_frees_its_blocks(start_agent, connect):
    """An import whose KV write fails after it took its blocks (a device error): the Decode fails, and the blocks
    are free again, so the site keeps taking work."""
    a, b = await start_agent("site-a"), await start_agent("site-b", kv_cache_bytes=POOL * 8192)
    client_a, client_b = connect(a), connect(b)
    engine_b = b.models[MODEL].engine
    params = sampling(max_tokens=4)
    ids = prompt(20)
    lease = await client_a.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=ids, sampling=params))

    def failing_write(*args, **kwargs):
        raise RuntimeError("out of device memory (test)")

    engine_b.engine._write_payload = failing_write
    with pytest.raises(aio.AioRpcError):
        await collect(client_b.decode(agent_pb2.DecodeRequest(
            model=MODEL, prompt_ids=ids, generated_ids=[lease.first_token.token_id], sampling=params,
            kv_source=agent_pb2.KVSource(address=a.address, kv_handle=lease.kv_handle))))
    assert await wait_for_free_blocks(client_b, POOL) == POOL
    figures = engine_b.admission_figures()
    assert (figures.num_pending, figures.num_pending_blocks, figures.num_reserved) == (0, 0, 0)
    whole_pool = agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(POOL * 16 - 1, start=3),
                                           sampling=sampling(max_tokens=1))
    assert len(await collect(client_b.generate(whole_pool))) == 1
