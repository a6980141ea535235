"""The one async client of the agent gRPC API: routers, peer agents (Decode pulling KV), tests and tools.

`AgentClient` is one channel to one agent: every call carries the bearer token and request id in
metadata, the `traceparent` of the request the calling task works for (node_agent.trace), and a
deadline. `AgentPool` keeps one client per address, reused by every request.

    async with AgentClient("127.0.0.1:50051", token) as agent:
        async for chunk in agent.generate(request, timeout=30):
            ...
    pool = AgentPool(token, credentials)       # grpc.ChannelCredentials for TLS, None for plaintext
    call = pool.client(site.grpc_address).decode(request, timeout=600)
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc import aio

from node_agent.auth import bearer_metadata
from node_agent.trace import outgoing_metadata
from node_agent.proto import agent_pb2, agent_pb2_grpc

MAX_MESSAGE_BYTES = 64 << 20  # above the largest KV chunk an engine exports
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # one stream can carry a whole prompt's KV: let its flow-control window grow with the link
    ("grpc.http2.bdp_probe", 1),
]
CHANNEL_OPTIONS = MESSAGE_OPTIONS + [
    # a dead peer behind a silent network is found in ~30 s, not at the OS's TCP timeout
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # a restarted agent is reached again within ~2 s
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


class AgentClient:
    def __init__(self, address: str, token: str, *, credentials: grpc.ChannelCredentials | None = None):
        self.address = address
        if credentials is not None:
            self._channel = aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
        else:
            self._channel = aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = agent_pb2_grpc.AgentStub(self._channel)
        self._bearer = bearer_metadata(token)

    def metadata(self, request_id: str | None = None) -> tuple[tuple[str, str], ...]:
        if request_id:
            return self._bearer + (("x-request-id", request_id),) + outgoing_metadata()
        return self._bearer + outgoing_metadata()

    def generate(self, request: agent_pb2.GenerateRequest, timeout: float | None = None) -> aio.UnaryStreamCall:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata(request.request_id))

    async def prefill(self, request: agent_pb2.PrefillRequest, timeout: float | None = None) -> agent_pb2.PrefillResult:
        return await self.stub.Prefill(request, timeout=timeout, metadata=self.metadata(request.request_id))

    def decode(self, request: agent_pb2.DecodeRequest, timeout: float | None = None) -> aio.UnaryStreamCall:
        return self.stub.Decode(request, timeout=timeout, metadata=self.metadata(request.request_id))

    def fetch_kv(self, kv_handle: str, timeout: float | None = None, request_id: str | None = None) -> aio.UnaryStreamCall:
        return self.stub.FetchKV(agent_pb2.FetchKVRequest(kv_handle=kv_handle), timeout=timeout,
                                 metadata=self.metadata(request_id))

    async def release_kv(self, kv_handle: str, timeout: float | None = None, request_id: str | None = None,
                         lease_id: str = "") -> bool:
        """Ends a lease by its handle, or by the lease id its Prefill carried (or both)."""
        response = await self.stub.ReleaseKV(agent_pb2.ReleaseKVRequest(kv_handle=kv_handle, lease_id=lease_id),
                                             timeout=timeout, metadata=self.metadata(request_id))
        return response.released

    async def model_info(self, model: str, timeout: float | None = None,
                         request_id: str | None = None) -> agent_pb2.ModelInfo:
        return await self.stub.GetModelInfo(agent_pb2.ModelInfoRequest(model=model), timeout=timeout,
                                            metadata=self.metadata(request_id))

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


class AgentPool:
    """One AgentClient (one channel) per agent address, all with the same token and credentials."""

    def __init__(self, token: str, credentials: grpc.ChannelCredentials | None = None) -> None:
        self._token = token
        self._credentials = credentials
        self._clients: dict[str, AgentClient] = {}

    def client(self, address: str) -> AgentClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = AgentClient(address, self._token, credentials=self._credentials)
        return client

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
