"""A KV lease ends when its caller gives up, not at its TTL: a Prefill the router abandons after the
agent leased (the answer still on its way), a release that overtakes its Prefill, and a decode site
whose pull fails before it read the lease. Every agent here holds leases for 300 s, so a lease that
is not released explicitly is still held when the test looks."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from grpc import aio

from engine.errors import KVTransferError
from node_agent.client import AgentPool
from node_agent.proto import agent_pb2
from router.generation import FailoverPolicy, Generation, GenerationFailed
from router.health import PassiveHealth
from tests.agent.conftest import MODEL, PEER_TOKEN, collect, prompt, sampling

LONG_TTL = {"kv_lease_ttl_s": 300.0}


async def _leases_when_settled(client, within_s: float = 5.0) -> int:
    """The agent's lease count once it reaches 0, or what it is after `within_s` (far below the TTL)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        leases = (await client.health()).num_kv_leases
        if leases == 0 or asyncio.get_running_loop().time() > deadline:
            return leases
        await asyncio.sleep(0.02)


def _split_generation(prefill_agent, decode_agent, agents: AgentPool, **policy) -> Generation:
    """One split pair, as placement would rank it (a generation reads only these fields of it)."""
    candidate = SimpleNamespace(prefill_site=SimpleNamespace(name="site-p", grpc_address=prefill_agent.address),
                                decode_site=SimpleNamespace(name="site-d", grpc_address=decode_agent.address),
                                colocated=False)
    return Generation("req-1", MODEL, prompt(40), sampling(max_tokens=8), [candidate], agents, PassiveHealth(),
                      FailoverPolicy(max_attempts=1, max_full_wait_s=0.0, **policy))


def _answer_lost_in_flight(agent) -> asyncio.Event:
    """From now on the agent leases the KV of each Prefill and its answer never reaches the caller
    (as when the caller gives up while the answer crosses the network). Set once a lease is made."""
    leased, prefill = asyncio.Event(), agent.core.prefill

    async def answered_but_lost(*args, **kwargs):
        await prefill(*args, **kwargs)
        leased.set()
        await asyncio.sleep(3600)
    agent.core.prefill = answered_but_lost
    return leased


@pytest.fixture
async def router_agents():
    pool = AgentPool(PEER_TOKEN)
    yield pool
    await pool.close()


async def test_router_that_gives_up_on_an_answered_prefill_ends_its_lease(start_agent, connect, router_agents):
    """The client hangs up after the prefill site leased the KV, before the answer reached the router."""
    prefill_agent, decode_agent = await start_agent("site-p", **LONG_TTL), await start_agent("site-d")
    leased = _answer_lost_in_flight(prefill_agent)
    generation = _split_generation(prefill_agent, decode_agent, router_agents)
    request = asyncio.ensure_future(anext(generation.steps()))
    await leased.wait()
    assert (await connect(prefill_agent).health()).num_kv_leases == 1
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    assert await _leases_when_settled(connect(prefill_agent)) == 0


async def test_router_whose_prefill_times_out_after_the_lease_ends_it(start_agent, connect, router_agents):
    """The first-token timeout passes while the answer is on its way: the request fails, the lease ends."""
    prefill_agent, decode_agent = await start_agent("site-p", **LONG_TTL), await start_agent("site-d")
    _answer_lost_in_flight(prefill_agent)
    generation = _split_generation(prefill_agent, decode_agent, router_agents, first_token_timeout_s=1.0)
    with pytest.raises(GenerationFailed):
        await anext(generation.steps())
    assert await _leases_when_settled(connect(prefill_agent)) == 0


async def test_release_that_overtakes_its_prefill_ends_the_lease(start_agent, connect):
    client = connect(await start_agent(**LONG_TTL))
    assert await client.release_kv("", lease_id="lease-early") is False  # nothing leased yet
    with pytest.raises(aio.AioRpcError) as refused:
        await client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt(30), sampling=sampling(),
                                                      lease_id="lease-early"))
    assert refused.value.code() == grpc.StatusCode.CANCELLED and "lease-early" in refused.value.details()
    assert (await client.health()).num_kv_leases == 0


async def test_release_while_its_prefill_runs_ends_the_lease_once_made(start_agent, connect):
    agent = await start_agent(**LONG_TTL)
    client = connect(agent)
    engine = agent.models[MODEL].engine
    entered, go_on, prefill = asyncio.Event(), asyncio.Event(), engine.prefill

    async def gated_prefill(*args, **kwargs):
        entered.set()
        await go_on.wait()
        return await prefill(*args, **kwargs)
    engine.prefill = gated_prefill
    call = asyncio.ensure_future(client.prefill(agent_pb2.PrefillRequest(
        model=MODEL, prompt_ids=prompt(30), sampling=sampling(), lease_id="lease-racing")))
    await entered.wait()
    assert await client.release_kv("", lease_id="lease-racing") is False  # the engine has not leased yet
    go_on.set()
    with pytest.raises(aio.AioRpcError) as refused:
        await call
    assert refused.value.code() == grpc.StatusCode.CANCELLED
    assert await _leases_when_settled(client) == 0


async def test_release_by_lease_id_after_the_answer(start_agent, connect):
    client = connect(await start_agent(**LONG_TTL))
    result = await client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt(30), sampling=sampling(),
                                                           lease_id="lease-late"))
    assert result.kv_handle and (await client.health()).num_kv_leases == 1
    assert await client.release_kv("", lease_id="lease-late") is True
    assert (await client.health()).num_kv_leases == 0
    assert await client.release_kv(result.kv_handle, lease_id="lease-late") is False  # ended once


async def test_decode_site_whose_pull_fails_before_reading_releases_the_lease(start_agent, connect):
    """The decode site cannot pull (here: the source unreachable before any chunk was asked for): it
    recomputes, same tokens as colocated, and the prefill site's lease ends with no TTL wait."""
    prefill_agent, decode_agent = await start_agent("site-p", **LONG_TTL), await start_agent("site-d")
    client_p, client_d = connect(prefill_agent), connect(decode_agent)

    async def unreachable(*_args, **_kwargs):
        raise KVTransferError(f"KV source {prefill_agent.address} is unreachable: UNAVAILABLE")
    decode_agent.core._fetch = unreachable
    prompt_ids, params = prompt(40), sampling()
    colocated = await collect(client_d.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt_ids,
                                                                          sampling=params)))
    result = await client_p.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids, sampling=params))
    decoded = await collect(client_d.decode(agent_pb2.DecodeRequest(
        model=MODEL, prompt_ids=prompt_ids, generated_ids=[result.first_token.token_id], sampling=params,
        kv_source=agent_pb2.KVSource(address=prefill_agent.address, kv_handle=result.kv_handle))))
    assert [result.first_token.token_id, *decoded] == colocated
    assert decode_agent.metrics.kv_fallbacks._value.get() == 1
    assert await _leases_when_settled(client_p) == 0


async def test_bad_lease_ids_are_refused(start_agent, connect):
    client = connect(await start_agent())
    with pytest.raises(aio.AioRpcError) as too_long:
        await client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt(10), sampling=sampling(),
                                                      lease_id="x" * 129))
    assert too_long.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 128" in too_long.value.details()
    with pytest.raises(aio.AioRpcError) as nameless:
        await client.release_kv("")
    assert nameless.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_handle" in nameless.value.details()
