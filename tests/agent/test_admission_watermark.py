"""Admission keeps the engine's watermark block as the engine keeps it, no more: beside other sequences only, and
with a request's first generated token counted in it when that token opens a block of its own (the engine
admits on the blocks of the request's tokens plus the watermark). A request the engine would run at once is
not refused; alone on an idle site a request may fill the pool, as its context (capped at the pool) allows."""

from __future__ import annotations

import asyncio

from node_agent.proto import agent_pb2
from tests.agent.conftest import MODEL, collect, prompt, sampling, wait_for_free_blocks
from tests.agent.test_admission_waiting import counted_waiting, generate, held_steps, wait_until

POOL = 9   # blocks of 16 tokens (kv_cache_bytes below)


def decode_request(ids: list[int], generated: list[int], lease=None, source=None) -> agent_pb2.DecodeRequest:
    request = agent_pb2.DecodeRequest(model=MODEL, prompt_ids=ids, generated_ids=generated,
                                      sampling=sampling(max_tokens=3))
    if lease is not None:
        request.kv_source.address, request.kv_source.kv_handle = source.address, lease.kv_handle
    return request


async def test_a_decode_filling_an_idle_sites_pool_is_served(start_agent, connect):
    """130 prompt tokens and the prefill's first token take all 9 blocks: an idle decode site imports the KV and
    serves it (it was refused for good, the watermark kept with no one to grow into it; and the engine, keeping it
    too, would have recomputed the prompt), and a resume sent with no KV source (a lost decode site's request)
    is served there too."""
    a, b = await start_agent("site-a"), await start_agent("site-b", kv_cache_bytes=POOL * 8192)
    client_a, client_b = connect(a), connect(b)
    ids = prompt(130)
    reference = await collect(client_a.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=ids,
                                                                           sampling=sampling(max_tokens=3))))
    lease = await client_a.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=ids,
                                                            sampling=sampling(max_tokens=3)))
    first = lease.first_token.token_id
    assert [first, *await collect(client_b.decode(decode_request(ids, [first], lease, a)))] == reference
    assert b.models[MODEL].engine.latest_stats.steps.num_prefill_tokens == 0   # imported, not recomputed
    assert await wait_for_free_blocks(client_b, POOL) == POOL
    assert [first, *await collect(client_b.decode(decode_request(ids, [first])))] == reference
    assert b.models[MODEL].engine.admission_figures().num_pending_blocks == 0
    assert await wait_for_free_blocks(client_b, POOL) == POOL


async def test_a_first_token_opening_a_block_takes_the_watermark(start_agent, connect):
    """Beside a running request holding 2 of 9 blocks, a 96-token prompt takes 6 blocks and its first generated
    token a seventh, which is the watermark the engine keeps: the engine runs it at once, so the agent admits it
    (it asked for 7 blocks and the watermark beside them, and refused)."""
    agent = await start_agent(kv_cache_bytes=POOL * 8192)
    client, engine = connect(agent), agent.models[MODEL].engine
    with held_steps(engine) as permits:
        running = asyncio.ensure_future(collect(client.generate(agent_pb2.GenerateRequest(
            model=MODEL, prompt_ids=prompt(20), sampling=sampling(max_tokens=4)))))
        await counted_waiting(engine, 1)
        permits.release()
        await wait_until(lambda: engine.latest_stats.num_running == 1)
        assert engine.latest_stats.num_blocks_free == POOL - 2
        fits = generate(client, prompt(96, start=3))
        await wait_until(lambda: fits.done() or (engine.latest_stats.num_waiting == 1
                                                 and not engine.admission_figures().num_pending))
        assert not fits.done(), fits.exception()   # refused: "needs 7 blocks, 6 of 9 are free for it"
        permits.release()
        await wait_until(lambda: engine.latest_stats.num_running == 2)   # the engine ran it in the next step
    assert [len(await running), len(await fits)] == [4, 2]
    assert await wait_for_free_blocks(client, POOL) == POOL
