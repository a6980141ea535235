"""An Embed call holds the KV blocks it was admitted on (those of its longest input) until its inputs' engine
requests start: a Generate arriving in between, when the call's tasks have not run yet, is refused rather than
admitted on the same free blocks; and the reservation is given back however the call ends."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from grpc import aio

from engine.errors import InvalidRequestError
from node_agent.proto import agent_pb2
from tests.agent.conftest import MODEL, collect, prompt, sampling, wait_for_free_blocks
from tests.agent.test_admission_reserve import wait_until
from tests.agent.test_embed_admission import vector

POOL = 8   # blocks of 16 tokens; an input of 20 tokens needs 2


def embed_request(request_id: str) -> agent_pb2.EmbedRequest:
    return agent_pb2.EmbedRequest(request_id=request_id, model=MODEL,
                                  inputs=[agent_pb2.EmbedInput(token_ids=prompt(20, start=i)) for i in (1, 2)])


async def outcome(call) -> str:
    """"served", or the details of the refusal."""
    try:
        await collect(call)
    except aio.AioRpcError as exc:
        return exc.details()
    return "served"


def zero(engine) -> bool:
    figures = engine.admission_figures()
    return (figures.num_pending, figures.num_pending_blocks, figures.num_reserved) == (0, 0, 0)


async def test_an_embed_holds_its_blocks_until_its_inputs_start(start_agent, connect):
    agent = await start_agent(kv_cache_bytes=POOL * 8192)
    client, engine = connect(agent), agent.models[MODEL].engine
    whole_pool = agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(POOL * 16 - 1, start=3),
                                           sampling=sampling(max_tokens=1))
    reference = await client.embed(embed_request("alone"))
    embed, generates = engine.embed, []

    async def embed_after_a_generate(*args, **kwargs):
        # The turn after the admission, before the input's engine request starts: a Generate needing every block.
        if not generates:
            generates.append(await outcome(client.generate(whole_pool)))
        return await embed(*args, **kwargs)

    engine.embed = embed_after_a_generate
    answer = await client.embed(embed_request("raced"))
    assert "KV pool is full" in generates[0]
    for embedding, alone in zip(answer.embeddings, reference.embeddings, strict=True):  # batched: float rounding
        np.testing.assert_allclose(vector(embedding), vector(alone), atol=1e-5)
    await wait_until(lambda: zero(engine))
    assert await wait_for_free_blocks(client, POOL) == POOL
    assert await outcome(client.generate(whole_pool)) == "served"


async def test_every_exit_gives_the_embed_reservation_back(start_agent, connect):
    """Cancelled before its inputs start, or refused by the engine: the whole pool is free for the next request."""
    agent = await start_agent(kv_cache_bytes=POOL * 8192)
    client, engine = connect(agent), agent.models[MODEL].engine
    whole_pool = agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(POOL * 16 - 1, start=3),
                                           sampling=sampling(max_tokens=1))
    embed, entered, release = engine.embed, [], asyncio.Event()

    async def held_embed(*args, **kwargs):
        entered.append(args)
        await release.wait()
        return await embed(*args, **kwargs)

    engine.embed = held_embed
    call = asyncio.ensure_future(client.embed(embed_request("cancelled")))
    await wait_until(lambda: entered)
    assert "KV pool is full" in await outcome(client.generate(whole_pool))
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    await wait_until(lambda: not agent.core.num_inflight)
    release.set()
    await wait_until(lambda: zero(engine))
    assert await outcome(client.generate(whole_pool)) == "served"

    engine.embed = embed
    add = engine.engine.add_embedding_request

    def refused_add(*args, **kwargs):
        raise InvalidRequestError("refused by the engine (test)")

    engine.engine.add_embedding_request = refused_add
    try:
        with pytest.raises(aio.AioRpcError) as refused:
            await client.embed(embed_request("refused"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        engine.engine.add_embedding_request = add
    await wait_until(lambda: zero(engine))
    assert await wait_for_free_blocks(client, POOL) == POOL
    assert await outcome(client.generate(whole_pool)) == "served"
