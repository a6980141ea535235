"""A KV transfer that goes wrong is detected, and Decode recomputes to the same tokens."""

from __future__ import annotations

import asyncio

import pytest

from node_agent.proto import agent_pb2
from tests.agent.conftest import MODEL, collect, prompt, sampling, wait_for_free_blocks

PARAMS = sampling(max_tokens=10, temperature=0.8, seed=7)


def corrupt(index_to_hit: int):
    async def hook(index, msg):
        if index == index_to_hit:
            data = bytearray(msg.data)
            data[len(data) // 2] ^= 0xFF
            msg.data = bytes(data)
        return msg
    return hook


def truncate(after: int):
    async def hook(index, msg):
        return None if index >= after else msg
    return hook


def die(agent, after: int):
    async def hook(index, msg):
        if index >= after:
            asyncio.get_running_loop().create_task(agent.kill_server())
            await asyncio.sleep(30)  # the server's stop cancels this stream mid-flight
        return msg
    return hook


def drop_layout():
    async def hook(index, msg):
        if index == 0:
            msg.kv_layout = msg.kv_layout.replace('"head_dim": 16', '"head_dim": 32')
        return msg
    return hook


async def split_decode(client_a, client_b, a, prompt_ids, handle=None):
    result = await client_a.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids, sampling=PARAMS))
    source = agent_pb2.KVSource(address=a if isinstance(a, str) else a.address, kv_handle=handle or result.kv_handle)
    decoded = await collect(client_b.decode(agent_pb2.DecodeRequest(
        model=MODEL, prompt_ids=prompt_ids, generated_ids=[result.first_token.token_id], sampling=PARAMS,
        kv_source=source), timeout=30))
    return [result.first_token.token_id, *decoded]


@pytest.mark.parametrize("fault", ["corrupt-first", "corrupt-last", "truncate", "layout", "dead-source"])
async def test_failed_transfer_is_detected_and_recomputed(start_agent, connect, fault):
    a, b = await start_agent("site-a"), await start_agent("site-b")
    client_a, client_b = connect(a), connect(b)
    free_a, free_b = (await client_a.health()).kv_blocks_free, (await client_b.health()).kv_blocks_free
    prompt_ids = prompt(40, start=11)
    reference = await collect(client_b.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt_ids,
                                                                          sampling=PARAMS)))
    num_chunks = 2 * 3  # 2 layers x 40 tokens in 16-token (2 KiB) chunks
    a.servicer.fetch_kv_hook = {
        "corrupt-first": corrupt(0), "corrupt-last": corrupt(num_chunks - 1), "truncate": truncate(num_chunks - 1),
        "layout": drop_layout(), "dead-source": die(a, 2)}[fault]

    tokens = await split_decode(client_a, client_b, a, prompt_ids)

    assert tokens == reference
    assert b.metrics.kv_fallbacks._value.get() == 1
    assert b.metrics.kv_bytes_received._value.get() == 0
    assert await wait_for_free_blocks(client_b, free_b) == free_b
    if fault != "dead-source":
        assert await wait_for_free_blocks(client_a, free_a) == free_a  # the broken fetch still ended the lease
    else:
        assert (await a.core.release_all_leases()) == 0  # the cancelled stream released its lease


async def test_unreachable_or_unknown_source_recomputes(start_agent, connect, unused_tcp_port):
    a, b = await start_agent("site-a"), await start_agent("site-b")
    client_a, client_b = connect(a), connect(b)
    prompt_ids = prompt(24, start=5)
    reference = await collect(client_b.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt_ids,
                                                                          sampling=PARAMS)))
    assert await split_decode(client_a, client_b, f"127.0.0.1:{unused_tcp_port}", prompt_ids) == reference
    assert await split_decode(client_a, client_b, a, prompt_ids, handle=f"{MODEL}/00ff") == reference
    assert b.metrics.kv_fallbacks._value.get() == 2
