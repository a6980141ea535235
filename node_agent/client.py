"""A small async client for one agent: a channel, the bearer token, and the stub's calls.

Decode uses it to pull KV from peers; tests and tools use it to drive agents.

    async with AgentClient("127.0.0.1:50051", token) as agent:
        async for chunk in agent.generate(request, timeout=30):
            ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc import aio

from node_agent.auth import bearer_metadata
from node_agent.proto import agent_pb2, agent_pb2_grpc

MAX_MESSAGE_BYTES = 64 << 20  # above the largest KV chunk an engine exports
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # one stream can carry a whole prompt's KV: let its flow-control window grow with the link
    ("grpc.http2.bdp_probe", 1),
]


class AgentClient:
    def __init__(self, address: str, token: str, *, tls_ca: bytes | None = None):
        self.address = address
        if tls_ca is not None:
            self._channel = aio.secure_channel(address, grpc.ssl_channel_credentials(tls_ca), options=CHANNEL_OPTIONS)
        else:
            self._channel = aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = agent_pb2_grpc.AgentStub(self._channel)
        self._token = token

    def metadata(self, request_id: str | None = None) -> tuple[tuple[str, str], ...]:
        metadata = bearer_metadata(self._token)
        if request_id:
            metadata += (("x-request-id", request_id),)
        return metadata

    def generate(self, request: agent_pb2.GenerateRequest, timeout: float | None = None) -> aio.UnaryStreamCall:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata(request.request_id))

    async def prefill(self, request: agent_pb2.PrefillRequest, timeout: float | None = None) -> agent_pb2.PrefillResult:
        return await self.stub.Prefill(request, timeout=timeout, metadata=self.metadata(request.request_id))

    def decode(self, request: agent_pb2.DecodeRequest, timeout: float | None = None) -> aio.UnaryStreamCall:
        return self.stub.Decode(request, timeout=timeout, metadata=self.metadata(request.request_id))

    def fetch_kv(self, kv_handle: str, timeout: float | None = None, request_id: str | None = None) -> aio.UnaryStreamCall:
        return self.stub.FetchKV(agent_pb2.FetchKVRequest(kv_handle=kv_handle), timeout=timeout,
                                 metadata=self.metadata(request_id))

    async def release_kv(self, kv_handle: str, timeout: float | None = None) -> bool:
        response = await self.stub.ReleaseKV(agent_pb2.ReleaseKVRequest(kv_handle=kv_handle), timeout=timeout,
                                             metadata=self.metadata())
        return response.released

    async def model_info(self, model: str, timeout: float | None = None) -> agent_pb2.ModelInfo:
        return await self.stub.GetModelInfo(agent_pb2.ModelInfoRequest(model=model), timeout=timeout,
                                            metadata=self.metadata())

    async def health(self, timeout: float | None = None) -> agent_pb2.HealthResponse:
        return await self.stub.Health(agent_pb2.HealthRequest(), timeout=timeout, metadata=self.metadata())

    async def drain(self, deadline_s: float, timeout: float | None = None) -> agent_pb2.DrainResponse:
        return await self.stub.Drain(agent_pb2.DrainRequest(deadline_s=deadline_s), timeout=timeout,
                                     metadata=self.metadata())

    async def tokens(self, call: aio.UnaryStreamCall) -> AsyncIterator[int]:
        """Token ids of a Generate or Decode stream, in order."""
        async for chunk in call:
            for token in chunk.tokens:
                yield token.token_id

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *_exc) -> None:
        await self.close()
