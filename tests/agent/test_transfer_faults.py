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


def use_transport(agent, transport: str, hook) -> None:
    """Route agent's outgoing KV through the data port (the default) or the FetchKV stream, with hook."""
    if transport == "grpc":
        agent.core.kv_data_server = None  # Health reports no data port; pullers use FetchKV
        agent.servicer.fetch_kv_hook = hook
    else:
        agent.core.kv_data_server.chunk_hook = hook


FAULTS = [("corrupt-first", "data-port"), ("corrupt-last", "data-port"), ("truncate", "data-port"),
          ("dead-source", "data-port"), ("corrupt-first", "grpc"), ("corrupt-last", "grpc"), ("truncate", "grpc"),
          ("layout", "grpc"), ("dead-source", "grpc")]


async def test_healthy_transfer_uses_the_data_port(start_agent, connect):
    a, b = await start_agent("site-a"), await start_agent("site-b")
    sent = []

    async def watch(index, msg):
        sent.append(index)
        return msg

    a.core.kv_data_server.chunk_hook = watch
    prompt_ids = prompt(40, start=3)
    reference = await collect(connect(b).generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt_ids,
                                                                            sampling=PARAMS)))
    assert await split_decode(connect(a), connect(b), a, prompt_ids) == reference
    assert sent == list(range(6)) and b.metrics.kv_fallbacks._value.get() == 0
    assert b.metrics.kv_bytes_received._value.get() == 40 * 2 * 2 * 2 * 16 * 4


@pytest.mark.parametrize("fault, transport", FAULTS)
async def test_failed_transfer_is_detected_and_recomputed(start_agent, connect, fault, transport):
    a, b = await start_agent("site-a"), await start_agent("site-b")
    client_a, client_b = connect(a), connect(b)
    free_a, free_b = (await client_a.health()).kv_blocks_free, (await client_b.health()).kv_blocks_free
    prompt_ids = prompt(40, start=11)
    reference = await collect(client_b.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt_ids,
                                                                          sampling=PARAMS)))
    num_chunks = 2 * 3  # 2 layers x 40 tokens in 16-token (2 KiB) chunks
    use_transport(a, transport, {
        "corrupt-first": corrupt(0), "corrupt-last": corrupt(num_chunks - 1), "truncate": truncate(num_chunks - 1),
        "layout": drop_layout(), "dead-source": die(a, 2)}[fault])

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


async def test_data_port_refuses_a_wrong_token_and_keeps_the_lease(start_agent, connect):
    from dataclasses import replace

    from engine.errors import KVTransferError
    from engine.kv_transfer import KVLayout
    from node_agent.kv_data import receive_bulk
    from tests.agent.conftest import PEER_TOKEN

    a = await start_agent("site-a")
    client = connect(a)
    prompt_ids = prompt(30, start=9)
    result = await client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids, sampling=PARAMS))
    layout = replace(KVLayout.from_json(result.kv_layout))
    data_address = f"127.0.0.1:{(await client.health()).kv_data_port}"
    with pytest.raises(KVTransferError, match="wrong peer token"):
        await receive_bulk(data_address, "not-the-token", result.kv_handle, layout, prompt_ids, timeout=10)
    payload = await receive_bulk(data_address, PEER_TOKEN, result.kv_handle, layout, prompt_ids, timeout=10)
    assert payload.num_bytes == result.kv_bytes
    with pytest.raises(KVTransferError, match="unknown, released or expired"):  # single use
        await receive_bulk(data_address, PEER_TOKEN, result.kv_handle, layout, prompt_ids, timeout=10)


def _request(kind: int, token: bytes, body: bytes) -> bytes:
    from node_agent.kv_data import KIND, LENGTH

    return KIND.pack(kind) + LENGTH.pack(len(token)) + token + LENGTH.pack(len(body)) + body


@pytest.mark.parametrize("sent, refusal", [
    (b"GET /health HTTP/1.1\r\nHost: agent\r\n\r\n", "wrong peer token"),   # a client at the wrong port
    (b"\x01\xff\xff" + b"x" * 64, "wrong peer token"),                     # a token length past what follows
    (_request(2, b"peer-secret", "²".encode()), "a probe asks for 1 to"),   # a digit that int() refuses
], ids=["http", "long-token", "probe-not-a-number"])
async def test_data_port_answers_bad_requests_at_once_and_keeps_serving(start_agent, connect, sent, refusal):
    """A request the data port cannot take gets an error header at once (not silence until its 10 s
    request timeout, nor a closed socket); a lease open meanwhile is still served whole."""
    import json

    from engine.kv_transfer import KVLayout
    from node_agent.kv_data import HEADER, receive_bulk
    from tests.agent.conftest import PEER_TOKEN

    a = await start_agent("site-a")
    client = connect(a)
    prompt_ids = prompt(30, start=4)
    result = await client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids, sampling=PARAMS))
    reader, writer = await asyncio.open_connection("127.0.0.1", a.core.kv_data_server.port)
    writer.write(sent)
    await writer.drain()
    try:
        (length,) = HEADER.unpack(await asyncio.wait_for(reader.readexactly(HEADER.size), 5))
        assert refusal in json.loads(await reader.readexactly(length))["error"]
        assert await reader.read() == b""  # and the connection is closed
    finally:
        writer.close()
    payload = await receive_bulk(f"127.0.0.1:{a.core.kv_data_server.port}", PEER_TOKEN, result.kv_handle,
                                 KVLayout.from_json(result.kv_layout), prompt_ids, timeout=10)
    assert payload.num_bytes == result.kv_bytes
    assert await a.core.num_leases() == 0


async def test_pulls_from_stalled_peers_do_not_hold_up_a_healthy_pull(start_agent, connect):
    """Many pulls stuck on peers that never answer (as many as asyncio's shared worker pool has
    threads) must not hold up a pull from a healthy peer: it completes over the data port at once."""
    import os
    import socket

    from engine.kv_transfer import KVLayout
    from node_agent.kv_data import receive_bulk
    from tests.agent.conftest import PEER_TOKEN

    a = await start_agent("site-a")
    client = connect(a)
    prompt_ids = prompt(30, start=8)
    result = await client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids, sampling=PARAMS))
    layout = KVLayout.from_json(result.kv_layout)
    silent = socket.create_server(("127.0.0.1", 0), backlog=64)  # accepts (the kernel does) and never answers
    stalled_address = f"127.0.0.1:{silent.getsockname()[1]}"
    num_stalled = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor size
    stalled = [asyncio.create_task(receive_bulk(stalled_address, PEER_TOKEN, "tiny/x", layout, prompt_ids, timeout=60))
               for _ in range(num_stalled)]
    try:
        await asyncio.sleep(0.2)  # every stalled pull has connected and waits for its header
        payload = await asyncio.wait_for(receive_bulk(f"127.0.0.1:{a.core.kv_data_server.port}", PEER_TOKEN,
                                                      result.kv_handle, layout, prompt_ids, timeout=60), 20)
        assert payload.num_bytes == result.kv_bytes
        assert not any(task.done() for task in stalled)
    finally:
        for task in stalled:
            task.cancel()
        await asyncio.gather(*stalled, return_exceptions=True)
        silent.close()
    assert await a.core.num_leases() == 0
