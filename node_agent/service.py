"""The gRPC servicer: translate protos, call AgentCore, map errors to status codes. Nothing else.

Each request RPC binds its task to the caller's request id and trace (`traceparent` metadata, a new
trace when there is none), so the agent's log lines and its calls to peers carry them (node_agent.trace).

`fetch_kv_hook` is a test seam: when set, every outgoing KV chunk passes through it, so tests can
corrupt, truncate or kill a transfer; returning None ends the stream there.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager

import grpc
from grpc import aio

from engine.async_engine import EngineDeadError, TokenEvent, kv_chunks
from engine.errors import EngineError, InvalidRequestError, KVTransferError, UnknownHandleError
from node_agent.convert import sampling_from_proto, token_chunk, token_to_proto
from node_agent.core import AgentCore, KVSource
from node_agent.errors import (AgentError, DrainingError, LeaseReleasedError, OverloadedError, UnknownModelError,
                               WrongRoleError)
from node_agent.proto import agent_pb2, agent_pb2_grpc
from node_agent.trace import bind, from_metadata, new_trace
from node_agent.transfer import chunk_message

log = logging.getLogger(__name__)

FetchKVHook = Callable[[int, agent_pb2.KVChunk], Awaitable[agent_pb2.KVChunk | None]]

_STATUS = [
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownModelError, grpc.StatusCode.NOT_FOUND),
    (UnknownHandleError, grpc.StatusCode.NOT_FOUND),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DrainingError, grpc.StatusCode.UNAVAILABLE),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (WrongRoleError, grpc.StatusCode.FAILED_PRECONDITION),
    (KVTransferError, grpc.StatusCode.DATA_LOSS),
    (LeaseReleasedError, grpc.StatusCode.CANCELLED),
]


def status_for(exc: Exception) -> grpc.StatusCode:
    return next((code for kind, code in _STATUS if isinstance(exc, kind)), grpc.StatusCode.INTERNAL)


@asynccontextmanager
async def grpc_errors(context: aio.ServicerContext, request_id: str):
    try:
        yield
    except (EngineError, AgentError) as exc:
        code = status_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("request %s failed", request_id)
        await context.abort(code, str(exc))


def _request_id(request_id: str, context: aio.ServicerContext) -> str:
    """The caller's id (field, else metadata) plus a suffix: an engine needs ids unique among its requests.
    Binds this RPC's task to the caller's id and trace (node_agent.trace)."""
    metadata = context.invocation_metadata() or ()
    base = request_id or dict(metadata).get("x-request-id") or "anon"
    caller = from_metadata(metadata)
    bind(base, caller.child() if caller is not None else new_trace())
    return f"{base}:{secrets.token_hex(4)}"


async def send_tokens(events: AsyncIterator[TokenEvent], context: aio.ServicerContext) -> None:
    """Writes the events as stream messages. An event that says another is already waiting (`more`) is
    held and sent with it, unless it is the last; an event is never held for one not yet made.

    Written with context.write from a coroutine handler rather than yielded from a generator one: the
    stream's tokens then pass through no generator of the servicer's, one resumption less per token."""
    held: list[TokenEvent] = []
    async with aclosing(events):  # a write that fails (the client left) must reach the engine's abort now
        async for event in events:
            held.append(event)
            if event.more and not event.finish_reason:
                continue
            await context.write(token_chunk(held))
            held = []


class AgentServicer(agent_pb2_grpc.AgentServicer):
    def __init__(self, core: AgentCore, on_drain: Callable[[float], None]):
        self.core = core
        self._on_drain = on_drain
        self.fetch_kv_hook: FetchKVHook | None = None

    async def Generate(self, request: agent_pb2.GenerateRequest, context: aio.ServicerContext) -> None:
        request_id = _request_id(request.request_id, context)
        async with grpc_errors(context, request_id):
            events = self.core.generate(request.model, list(request.prompt_ids), list(request.generated_ids),
                                        sampling_from_proto(request.sampling), request_id)
            await send_tokens(events, context)

    async def Prefill(self, request: agent_pb2.PrefillRequest, context: aio.ServicerContext):
        request_id = _request_id(request.request_id, context)
        async with grpc_errors(context, request_id):
            outcome = await self.core.prefill(request.model, list(request.prompt_ids),
                                              sampling_from_proto(request.sampling), request_id, request.lease_id)
            first = outcome.first
            return agent_pb2.PrefillResult(
                first_token=token_to_proto(first), kv_handle=outcome.kv_handle,
                num_prompt_tokens=first.num_prompt_tokens, num_cached_tokens=first.num_cached_tokens,
                kv_layout=outcome.kv_layout_json, kv_bytes=outcome.kv_bytes, finish_reason=first.finish_reason or "",
                lease_ttl_s=self.core.config.kv_lease_ttl_s if outcome.kv_handle else 0.0)

    async def FetchKV(self, request: agent_pb2.FetchKVRequest, context: aio.ServicerContext):
        request_id = _request_id("", context)
        with self.core.inflight():
            async with grpc_errors(context, request_id):
                export = await self.core.open_export(request.kv_handle)
            ended = False

            def end() -> None:
                # single use: the lease ends with its stream, read whole or not; once the last chunk
                # is gathered it ends before that chunk goes out, so a second fetch finds it gone
                nonlocal ended
                if not ended:
                    ended = True
                    self.core.end_export(request.kv_handle, export)
            try:
                index = 0
                async for chunk in kv_chunks(export):
                    if index == export.num_chunks - 1:
                        end()
                    msg = chunk_message(chunk, export if index == 0 else None)
                    if self.fetch_kv_hook is not None:
                        msg = await self.fetch_kv_hook(index, msg)
                        if msg is None:
                            return
                    yield msg
                    self.core.metrics.kv_bytes_sent.inc(len(msg.data))
                    index += 1
            finally:
                end()

    async def ReleaseKV(self, request: agent_pb2.ReleaseKVRequest, context: aio.ServicerContext):
        request_id = _request_id("", context)
        async with grpc_errors(context, request_id):
            released = await self.core.release_kv(request.kv_handle, request.lease_id)
            return agent_pb2.ReleaseKVResponse(released=released)

    async def Decode(self, request: agent_pb2.DecodeRequest, context: aio.ServicerContext):
        request_id = _request_id(request.request_id, context)
        source = None
        if request.HasField("kv_source") and request.kv_source.address:
            source = KVSource(request.kv_source.address, request.kv_source.kv_handle)
        async with grpc_errors(context, request_id):
            events = self.core.decode(request.model, list(request.prompt_ids), list(request.generated_ids),
                                      sampling_from_proto(request.sampling), source, request_id,
                                      context.time_remaining())
            await send_tokens(events, context)

    async def GetModelInfo(self, request: agent_pb2.ModelInfoRequest, context: aio.ServicerContext):
        async with grpc_errors(context, "model-info"):
            return self.core.model(request.model).info

    async def Health(self, request: agent_pb2.HealthRequest, context: aio.ServicerContext):
        response = agent_pb2.HealthResponse(
            status=agent_pb2.HealthResponse.DRAINING if self.core.draining else agent_pb2.HealthResponse.SERVING,
            site=self.core.config.site, models=list(self.core.models),
            kv_data_port=self.core.kv_data_server.port if self.core.kv_data_server else 0)
        for model in self.core.models.values():
            if not model.engine.alive:
                response.status = agent_pb2.HealthResponse.NOT_SERVING
                continue
            stats = await model.engine.stats()
            response.kv_blocks_total += stats.num_blocks_total
            response.kv_blocks_free += stats.num_blocks_free
            response.num_running += stats.num_running
            response.num_waiting += stats.num_waiting
            response.num_kv_leases += stats.num_pinned_handles
        return response

    async def Drain(self, request: agent_pb2.DrainRequest, context: aio.ServicerContext):
        deadline_s = request.deadline_s if request.deadline_s > 0 else self.core.config.drain_timeout_s
        self._on_drain(deadline_s)
        return agent_pb2.DrainResponse(draining=True, num_inflight=self.core.num_inflight)
