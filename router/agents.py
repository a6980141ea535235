"""gRPC channels to agents: one channel per address, reused by every request.

Each call carries the peer token and request id in metadata and a deadline, per agent.proto.
"""

from __future__ import annotations

import grpc

from node_agent.proto import agent_pb2, agent_pb2_grpc

# Errors after which another site may well succeed; anything else is the request's own fault.
RETRYABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION,
})
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


class AgentPool:
    def __init__(self, peer_token: str = "") -> None:
        self._peer_token = peer_token
        self._stubs: dict[str, agent_pb2_grpc.AgentStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> agent_pb2_grpc.AgentStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            self._channels[address] = channel
            stub = self._stubs[address] = agent_pb2_grpc.AgentStub(channel)
        return stub

    def metadata(self, request_id: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self._peer_token}"), ("x-request-id", request_id))

    def generate(self, address: str, request: agent_pb2.GenerateRequest, timeout_s: float):
        return self.stub(address).Generate(request, timeout=timeout_s, metadata=self.metadata(request.request_id))

    def decode(self, address: str, request: agent_pb2.DecodeRequest, timeout_s: float):
        return self.stub(address).Decode(request, timeout=timeout_s, metadata=self.metadata(request.request_id))

    async def prefill(self, address: str, request: agent_pb2.PrefillRequest, timeout_s: float):
        return await self.stub(address).Prefill(request, timeout=timeout_s, metadata=self.metadata(request.request_id))

    async def release_kv(self, address: str, kv_handle: str, request_id: str, timeout_s: float = 5.0) -> bool:
        response = await self.stub(address).ReleaseKV(agent_pb2.ReleaseKVRequest(kv_handle=kv_handle),
                                                      timeout=timeout_s, metadata=self.metadata(request_id))
        return response.released

    async def model_info(self, address: str, model: str, request_id: str, timeout_s: float = 10.0):
        return await self.stub(address).GetModelInfo(agent_pb2.ModelInfoRequest(model=model), timeout=timeout_s,
                                                     metadata=self.metadata(request_id))

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
