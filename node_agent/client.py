"""The one async client of the agent gRPC API: routers, peer agents (Decode pulling KV), tests and tools.

`AgentClient` is one channel to one agent: every call carries the bearer token and request id in
metadata, the `traceparent` of the request the calling task works for (node_agent.trace), and a
deadline. `AgentPool` keeps one client per address, reused by every request.

    async with AgentClient("127.0.0.1:50051", token) as agent:
        async for chunk in agent.generate(request, timeout=30):
            ...
    pool = AgentPool(token, credentials)       # grpc.ChannelCredentials for TLS, None for plaintext
    call = pool.client(site.grpc_address).decode(request, timeout=600)

With `sessions=True` (the router's default, router.config `agent_sessions`), `generate` and `decode` send
their requests over one long-lived Session stream per client (opened on first use, again after one
breaks), and the agent relays each engine step's tokens of all of them as one message. Each request still
gets a call of its own with the per-request call's surface (`read`, `async for`, `cancel`; the same
chunks, the same AioRpcError codes, its own deadline), so callers cannot tell the two apart; a broken
session fails each of its requests with the session's status, as a broken per-request stream does. An
agent that answers Session with UNIMPLEMENTED (older than the RPC) gets per-request calls from then on,
those it had been sent over the session included. A pool's `observer` (a SessionObserver: the router's
metrics) hears of each session that broke with requests open and each request sent per request for want
of the RPC; `open_sessions()` lists the addresses with a session open.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from grpc import aio

from node_agent.auth import bearer_metadata
from node_agent.trace import HEADER, STATE_HEADER, outgoing_metadata
from node_agent.proto import agent_pb2, agent_pb2_grpc

MAX_MESSAGE_BYTES = 64 << 20  # above the largest KV chunk an engine exports
SESSION_MESSAGE_BYTES = 16 << 20  # a Session message's opens stop once they pass this (the next ones wait)
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

log = logging.getLogger(__name__)


class SessionObserver(Protocol):
    """Told of a client's session events, on the event loop (so it must not block)."""

    def session_broken(self, address: str) -> None:
        """A session to `address` ended with an error while requests were open (they failed with it)."""

    def sent_per_request(self, address: str) -> None:
        """A request meant for a session went out as its own call: the agent has no Session RPC."""


class AgentClient:
    def __init__(self, address: str, token: str, *, credentials: grpc.ChannelCredentials | None = None,
                 sessions: bool = False, observer: SessionObserver | None = None):
        self.address = address
        self.sessions = sessions   # turned off for good when the agent answers Session with UNIMPLEMENTED
        self._wants_sessions = sessions
        self.observer = observer
        self._session: AgentSession | None = None
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

    def generate(self, request: agent_pb2.GenerateRequest,
                 timeout: float | None = None) -> aio.UnaryStreamCall | SessionCall:
        if self.sessions:
            return self._session_call("generate", request, timeout)
        return self.per_request_call("generate", request, timeout, self.metadata(request.request_id))

    async def prefill(self, request: agent_pb2.PrefillRequest, timeout: float | None = None) -> agent_pb2.PrefillResult:
        return await self.stub.Prefill(request, timeout=timeout, metadata=self.metadata(request.request_id))

    def decode(self, request: agent_pb2.DecodeRequest,
               timeout: float | None = None) -> aio.UnaryStreamCall | SessionCall:
        if self.sessions:
            return self._session_call("decode", request, timeout)
        return self.per_request_call("decode", request, timeout, self.metadata(request.request_id))

    def _session_call(self, kind: str, request, timeout: float | None) -> SessionCall:
        session = self._session
        if session is None or session.ended:
            # in a context of its own: the session's tasks work for no one request
            session = self._session = contextvars.Context().run(AgentSession, self)
        return session.open(kind, request, timeout, self.metadata(request.request_id))

    def per_request_call(self, kind: str, request, timeout: float | None,
                         metadata: tuple[tuple[str, str], ...]) -> aio.UnaryStreamCall:
        """A Generate or Decode call of its own: sessions off, or an agent without the Session RPC."""
        if self._wants_sessions and self.observer is not None:
            self.observer.sent_per_request(self.address)
        method = self.stub.Generate if kind == "generate" else self.stub.Decode
        return method(request, timeout=timeout, metadata=metadata)

    def session_ended(self, session: AgentSession, unimplemented: bool) -> None:
        if unimplemented and self.sessions:
            log.info("agent %s has no Session RPC (an older agent); sending it per-request calls", self.address)
            self.sessions = False
        if self._session is session:
            self._session = None

    def fetch_kv(self, kv_handle: str, timeout: float | None = None, request_id: str | None = None) -> aio.UnaryStreamCall:
        return self.stub.FetchKV(agent_pb2.FetchKVRequest(kv_handle=kv_handle), timeout=timeout,
                                 metadata=self.metadata(request_id))

    async def release_kv(self, kv_handle: str, timeout: float | None = None, request_id: str | None = None,
                         lease_id: str = "") -> bool:
        """Ends a lease by its handle, or by the lease id its Prefill carried (or both)."""
        response = await self.stub.ReleaseKV(agent_pb2.ReleaseKVRequest(kv_handle=kv_handle, lease_id=lease_id),
                                             timeout=timeout, metadata=self.metadata(request_id))
        return response.released

    async def embed(self, request: agent_pb2.EmbedRequest, timeout: float | None = None) -> agent_pb2.EmbedResponse:
        """Embeddings of the request's inputs, in order (each `data` little-endian float32)."""
        return await self.stub.Embed(request, timeout=timeout, metadata=self.metadata(request.request_id))

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
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        await self._channel.close()

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *_exc) -> None:
        await self.close()


class AgentPool:
    """One AgentClient (one channel) per agent address, all with the same token and credentials."""

    def __init__(self, token: str, credentials: grpc.ChannelCredentials | None = None, sessions: bool = False,
                 observer: SessionObserver | None = None) -> None:
        self._token = token
        self._credentials = credentials
        self._sessions = sessions
        self._observer = observer
        self._clients: dict[str, AgentClient] = {}

    def client(self, address: str) -> AgentClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = AgentClient(address, self._token, credentials=self._credentials,
                                                          sessions=self._sessions, observer=self._observer)
        return client

    def open_sessions(self) -> list[str]:
        """The addresses whose client holds a Session stream open (one at most per client)."""
        return [address for address, client in list(self._clients.items())
                if client._session is not None and not client._session.ended]

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _rpc_error(code: grpc.StatusCode, details: str) -> aio.AioRpcError:
    return aio.AioRpcError(code, aio.Metadata(), aio.Metadata(), details)


class AgentSession:
    """One Session stream to an agent: opens and cancels go out batched (one message per wake-up of its
    sender), and each batch that comes back is handed out to its requests' calls by id."""

    def __init__(self, client: AgentClient) -> None:
        self._client = client
        self._loop = asyncio.get_running_loop()
        self._calls: dict[int, SessionCall] = {}
        self._next_id = 1
        self._opens: list[agent_pb2.SessionOpen] = []
        self._cancels: list[int] = []
        self._send_wake: asyncio.Future | None = None
        self.ended = False
        self._closed = False
        self.num_batches = 0   # messages received: what a per-request stream would have sent one per chunk
        self._call = client.stub.Session(self._requests(), metadata=client.metadata())
        self._reader = asyncio.ensure_future(self._read())

    def open(self, kind: str, request, timeout: float | None, metadata: tuple[tuple[str, str], ...]) -> SessionCall:
        session_id, self._next_id = self._next_id, self._next_id + 1
        call = self._calls[session_id] = SessionCall(self, session_id, kind, request, timeout, metadata)
        item = agent_pb2.SessionOpen(id=session_id, **{kind: request})
        if timeout is not None:
            item.timeout_s = timeout
        for key, value in metadata:
            if key == HEADER:
                item.traceparent = value
            elif key == STATE_HEADER:
                item.tracestate = value
        self._opens.append(item)
        self._wake_sender()
        return call

    def cancel(self, session_id: int) -> None:
        if self._calls.pop(session_id, None) is not None and not self.ended:
            unsent = next((item for item in self._opens if item.id == session_id), None)
            if unsent is not None:   # its open has not gone out: it never will
                self._opens.remove(unsent)
                return
            self._cancels.append(session_id)
            self._wake_sender()

    async def close(self) -> None:
        self._closed = True
        self._call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    def _wake_sender(self) -> None:
        wake = self._send_wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _requests(self) -> AsyncIterator[agent_pb2.SessionRequest]:
        while not self.ended:
            if not self._opens and not self._cancels:
                self._send_wake = self._loop.create_future()
                await self._send_wake
                continue
            opens, size = 0, 0   # a burst of long prompts goes out over several messages, each well under the limit
            while opens < len(self._opens) and (not opens or size < SESSION_MESSAGE_BYTES):
                size += self._opens[opens].ByteSize()
                opens += 1
            message = agent_pb2.SessionRequest(open=self._opens[:opens], cancel=self._cancels)
            self._opens, self._cancels = self._opens[opens:], []
            yield message

    async def _read(self) -> None:
        error = _rpc_error(grpc.StatusCode.UNAVAILABLE, f"agent {self._client.address} ended the session")
        try:
            calls = self._calls
            async for batch in self._call:
                self.num_batches += 1
                for item in batch.items:
                    call = calls.get(item.id)
                    if call is None:
                        continue  # cancelled here meanwhile
                    if item.HasField("chunk"):
                        call.put(item.chunk)
                    if item.finished:
                        del calls[item.id]
                        call.finish(item.error if item.HasField("error") else None)
        except aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = _rpc_error(grpc.StatusCode.CANCELLED, "the session to the agent was closed")
        finally:
            self._end(error)

    def _end(self, error: aio.AioRpcError) -> None:
        self.ended = True
        self._wake_sender()
        unimplemented = error.code() == grpc.StatusCode.UNIMPLEMENTED
        self._client.session_ended(self, unimplemented)
        # An agent without the RPC answers UNIMPLEMENTED, now and then INTERNAL or UNKNOWN (its servicer's
        # NotImplementedError racing the request stream): a session that failed so before it carried
        # anything sends its requests as per-request calls, which answer for the agent itself.
        fall_back = unimplemented or (not self.num_batches and not self._closed
                                      and error.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN))
        calls, self._calls = list(self._calls.values()), {}
        if calls and not fall_back and not self._closed:
            log.warning("session to agent %s ended (%s: %s); failing its %d open request(s)", self._client.address,
                        error.code().name, error.details(), len(calls))
            if self._client.observer is not None:
                self._client.observer.session_broken(self._client.address)
        for call in calls:
            if fall_back:
                call.fall_back(self._client)
            else:
                call.fail(error)


class SessionCall:
    """One request over a session, read as its per-request Generate or Decode call would be: `read()` (a
    TokenChunk, or grpc.aio.EOF after the last), `async for`, `cancel()`; a failure raises the AioRpcError
    that call would (the agent's status, DEADLINE_EXCEEDED at `timeout`, the session's when it broke)."""

    __slots__ = ("_session", "_id", "_kind", "_request", "_metadata", "_chunks", "_waiter", "_done", "_error",
                 "_cancelled", "_timer", "_deadline", "_fallback")

    def __init__(self, session: AgentSession, session_id: int, kind: str, request, timeout: float | None,
                 metadata: tuple[tuple[str, str], ...]) -> None:
        self._session = session
        self._id = session_id
        self._kind = kind
        self._request = request
        self._metadata = metadata
        self._chunks: deque[agent_pb2.TokenChunk] = deque()
        self._waiter: asyncio.Future | None = None
        self._done = False
        self._error: aio.AioRpcError | None = None
        self._cancelled = False
        loop = session._loop
        self._deadline = None if timeout is None else loop.time() + timeout
        self._timer = None if timeout is None else loop.call_at(self._deadline, self._expire)
        self._fallback: aio.UnaryStreamCall | None = None

    async def read(self):
        while True:
            if self._fallback is not None:
                return await self._fallback.read()
            if self._chunks:
                return self._chunks.popleft()
            if self._cancelled:
                raise asyncio.CancelledError()
            if self._error is not None:
                raise self._error
            if self._done:
                return aio.EOF
            self._waiter = self._session._loop.create_future()
            await self._waiter

    def __aiter__(self) -> SessionCall:
        return self

    async def __anext__(self) -> agent_pb2.TokenChunk:
        chunk = await self.read()
        if chunk is aio.EOF:
            raise StopAsyncIteration
        return chunk

    def cancel(self) -> bool:
        if self._fallback is not None:
            return self._fallback.cancel()
        if self._done or self._error is not None or self._cancelled:
            return False
        self._cancelled = True
        self._chunks.clear()   # as a cancelled call's: nothing more is read
        self._stop()
        self._session.cancel(self._id)
        return True

    def done(self) -> bool:
        return self._done or self._error is not None or self._cancelled

    def put(self, chunk: agent_pb2.TokenChunk) -> None:
        self._chunks.append(chunk)
        self._wake()

    def finish(self, error: agent_pb2.SessionError | None) -> None:
        if error is not None:
            self._error = _rpc_error(_STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN), error.message)
        self._done = True
        self._stop()

    def fail(self, error: aio.AioRpcError) -> None:
        if not self.done():
            self._error = error
            self._stop()

    def fall_back(self, client: AgentClient) -> None:
        """The agent has no Session RPC: the request goes out as its own call, with what is left of its time."""
        timeout = None if self._deadline is None else max(self._deadline - self._session._loop.time(), 0.001)
        self._stop()
        if not self.done():
            self._fallback = client.per_request_call(self._kind, self._request, timeout, self._metadata)

    def _expire(self) -> None:
        self._timer = None
        if not self.done():
            self._error = _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            self._stop()
            self._session.cancel(self._id)

    def _stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)
