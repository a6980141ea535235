"""Agents over TLS: gRPC and the KV data port encrypted, client certificates demanded (mutual TLS),
the same tokens as in clear, and nothing readable on the wire."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import httpx
import pytest

from engine.errors import KVTransferError
from node_agent.kv_data import receive_bulk
from node_agent.proto import agent_pb2
from node_agent.tls import channel_credentials, client_context
from tests.agent.conftest import MODEL, PEER_TOKEN, collect, prompt, sampling


def tls_settings(tls) -> dict:
    return dict(tls_cert=tls.cert, tls_key=tls.key, tls_ca=tls.ca, tls_client_ca=tls.ca)


class Relay:
    """A TCP relay that keeps every byte it forwards, both ways: what an eavesdropper on the link sees."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.seen = bytearray()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> Relay:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _relay(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def _pipe(self, reader, writer) -> None:
        try:
            while data := await reader.read(1 << 16):
                self.seen += data
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def stop(self) -> None:
        self._server.close()


async def test_split_over_tls_pulls_kv_over_the_tls_data_port(start_agent, connect, local_tls):
    a, b = await start_agent("site-a", **tls_settings(local_tls)), await start_agent("site-b", **tls_settings(local_tls))
    fetch_kv_chunks = []

    async def record(index, msg):
        fetch_kv_chunks.append(index)
        return msg
    a.servicer.fetch_kv_hook = record
    credentials = channel_credentials(local_tls.ca, local_tls.cert, local_tls.key)
    client_a, client_b = connect(a, credentials=credentials), connect(b, credentials=credentials)
    params, prompt_ids = sampling(temperature=0.5, seed=5), prompt(33)

    reference = await collect(client_a.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt_ids,
                                                                          sampling=params)))
    result = await client_a.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids, sampling=params))
    decoded = await collect(client_b.decode(agent_pb2.DecodeRequest(
        model=MODEL, prompt_ids=prompt_ids, generated_ids=[result.first_token.token_id], sampling=params,
        kv_source=agent_pb2.KVSource(address=a.address, kv_handle=result.kv_handle))))

    assert [result.first_token.token_id, *decoded] == reference
    assert b.metrics.kv_fallbacks._value.get() == 0 and b.metrics.kv_bytes_received._value.get() == result.kv_bytes
    assert fetch_kv_chunks == []  # the bytes came over the data port, not FetchKV
    assert (await client_a.health()).num_kv_leases == 0  # the read ended the lease


async def test_plaintext_and_certificateless_callers_are_refused(start_agent, connect, local_tls):
    agent = await start_agent("site-a", **tls_settings(local_tls))
    with pytest.raises(grpc.aio.AioRpcError) as plaintext:
        await connect(agent).health(timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as certificateless:
        await connect(agent, credentials=channel_credentials(local_tls.ca)).health(timeout=5)
    assert plaintext.value.code() == certificateless.value.code() == grpc.StatusCode.UNAVAILABLE

    result = await connect(agent, credentials=channel_credentials(local_tls.ca, local_tls.cert, local_tls.key)).prefill(
        agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt(20), sampling=sampling()))
    data_address = f"127.0.0.1:{agent.core.kv_data_server.port}"
    layout = replace(agent.models[MODEL].kv_layout, num_tokens=20)
    for ssl_context in (None, client_context(local_tls.ca)):  # in clear; TLS without a client certificate
        with pytest.raises(KVTransferError):
            await receive_bulk(data_address, PEER_TOKEN, result.kv_handle, layout, prompt(20), 5, ssl_context)
    payload = await receive_bulk(data_address, PEER_TOKEN, result.kv_handle, layout, prompt(20), 5,
                                 client_context(local_tls.ca, local_tls.cert, local_tls.key))
    assert payload.num_bytes == result.kv_bytes


async def test_nothing_crosses_in_clear(start_agent, connect, local_tls):
    """An eavesdropper between caller and agent sees neither the peer token nor the KV bytes."""
    agent = await start_agent("site-a", **tls_settings(local_tls))
    grpc_relay = await Relay(int(agent.address.rpartition(":")[2])).start()
    data_relay = await Relay(agent.core.kv_data_server.port).start()
    try:
        client = connect(f"127.0.0.1:{grpc_relay.port}",
                         credentials=channel_credentials(local_tls.ca, local_tls.cert, local_tls.key))
        result = await client.prefill(agent_pb2.PrefillRequest(request_id="req-visible-in-clear", model=MODEL,
                                                               prompt_ids=prompt(40), sampling=sampling()))
        layout = replace(agent.models[MODEL].kv_layout, num_tokens=40)
        payload = await receive_bulk(f"127.0.0.1:{data_relay.port}", PEER_TOKEN, result.kv_handle, layout,
                                     prompt(40), 5, client_context(local_tls.ca, local_tls.cert, local_tls.key))
    finally:
        await grpc_relay.stop()
        await data_relay.stop()
    assert payload.num_bytes == result.kv_bytes > 0
    assert len(grpc_relay.seen) > 1000 and len(data_relay.seen) > payload.num_bytes  # the traffic did pass
    for seen in (grpc_relay.seen, data_relay.seen):
        assert PEER_TOKEN.encode() not in seen and b"req-visible-in-clear" not in seen
        assert result.kv_handle.encode() not in seen
    kv_sample = bytes(payload.chunks[0].data[:64])
    assert len(set(kv_sample)) > 8 and kv_sample not in data_relay.seen  # a stretch of real KV bytes


async def test_metrics_over_https(start_agent, local_tls):
    agent = await start_agent("site-a", metrics_listen="127.0.0.1:0", metrics_tls=True, **tls_settings(local_tls))
    async with httpx.AsyncClient(verify=client_context(local_tls.ca), timeout=5) as https:
        scraped = await https.get(f"https://127.0.0.1:{agent.metrics_port}/metrics")
    assert scraped.status_code == 200 and "edgefire_agent_kv_blocks_free" in scraped.text
    async with httpx.AsyncClient(timeout=5) as plain:
        with pytest.raises(httpx.HTTPError):
            await plain.get(f"http://127.0.0.1:{agent.metrics_port}/metrics")
