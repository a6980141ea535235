"""An Embed call larger than the site's KV pool is served: its inputs queue in the engine and run as blocks
free up (each input's KV is freed once it is pooled), as many prompts sent at once would; only an input that
could not fit even alone is refused as a full site, and the vectors are those of the inputs embedded alone
(to float32 rounding: a batch's matmuls sum in another order)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc import aio

from node_agent.proto import agent_pb2

from .conftest import MODEL


def vector(embedding: agent_pb2.Embedding) -> np.ndarray:
    return np.frombuffer(embedding.data, dtype="<f4")


def inputs(count: int, length: int) -> list[agent_pb2.EmbedInput]:
    return [agent_pb2.EmbedInput(token_ids=[(7 + 13 * i + 5 * j) % 500 + 5 for j in range(length)])
            for i in range(count)]


async def test_a_call_whose_inputs_together_exceed_the_kv_pool_is_served(start_agent, connect):
    agent = await start_agent()
    client = connect(agent)
    health = await client.health()
    pool_tokens = health.kv_blocks_total * 16
    many = inputs(count=pool_tokens // 100 + 20, length=100)   # together more tokens than the pool holds
    assert sum(len(item.token_ids) for item in many) > pool_tokens
    answer = await client.embed(agent_pb2.EmbedRequest(request_id="many", model=MODEL, inputs=many), timeout=120)
    assert len(answer.embeddings) == len(many)
    for index in (0, len(many) // 2, len(many) - 1):
        alone = await client.embed(agent_pb2.EmbedRequest(request_id=f"one-{index}", model=MODEL,
                                                          inputs=[many[index]]), timeout=60)
        np.testing.assert_allclose(vector(alone.embeddings[0]), vector(answer.embeddings[index]), atol=1e-5)
    assert (await client.health()).kv_blocks_free == health.kv_blocks_free   # every input's KV freed


async def test_an_input_the_free_kv_cannot_hold_now_is_refused_as_a_full_site(start_agent, connect):
    """Refused with RESOURCE_EXHAUSTED (the router tries another site or waits for room); an input longer than the
    model's context on this site is INVALID_ARGUMENT naming it."""
    agent = await start_agent(kv_cache_bytes=64 << 10)   # a pool of 8 blocks: 128 tokens
    client = connect(agent)
    # A prefill's KV lease holds its prompt's blocks until released (a generating request would free them when it
    # finished, which on a busy machine could be before the embedding is admitted)
    lease = await client.prefill(agent_pb2.PrefillRequest(
        request_id="holder", model=MODEL, prompt_ids=[5 + i for i in range(90)],
        sampling=agent_pb2.SamplingParams(max_tokens=30, ignore_eos=True)), timeout=60)
    with pytest.raises(aio.AioRpcError) as refused:
        await client.embed(agent_pb2.EmbedRequest(request_id="long", model=MODEL, inputs=inputs(1, 90)), timeout=60)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV pool is full" in refused.value.details()
    assert await client.release_kv(lease.kv_handle)
    assert len((await client.embed(agent_pb2.EmbedRequest(request_id="later", model=MODEL, inputs=inputs(1, 90)),
                                   timeout=60)).embeddings) == 1   # once the KV is free again
    with pytest.raises(aio.AioRpcError) as too_long:
        await client.embed(agent_pb2.EmbedRequest(request_id="huge", model=MODEL, inputs=inputs(2, 200)), timeout=60)
    assert too_long.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert too_long.value.details().startswith("inputs[0]: 200 tokens")
