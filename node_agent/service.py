"""The gRPC servicer: translate protos, call AgentCore, map errors to status codes. Nothing else.

Each request RPC binds its task to the caller's request id and trace (`traceparent` metadata, a new
trace when there is none), so the agent's log lines and its calls to peers carry them (node_agent.trace).

`Session` carries Generate and Decode for many requests of one router over one stream: each request it
opens runs exactly as the per-request call would (the same admission, engine path and status codes), and
one SessionBatch per wake-up of the session (one engine step: the engine hands a step's tokens to the
event loop at once) holds what every request made, so the agent writes one message per step and router
rather than one per step and request (benchmarks/agent_relay.py measures both).

`fetch_kv_hook` is a test seam: when set, every outgoing KV chunk passes through it, so tests can
corrupt, truncate or kill a transfer; returning None ends the stream there.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager

import grpc
from grpc import aio

from engine.async_engine import EngineDeadError, TokenEvent, kv_chunks, prediction_counts
from engine.errors import EngineError, InvalidRequestError, KVTransferError, UnknownHandleError
from node_agent.convert import sampling_from_proto, token_chunk, token_to_proto
from node_agent.core import AgentCore, KVSource
from node_agent.errors import (AgentError, DrainingError, LeaseReleasedError, OverloadedError, UnknownModelError,
                               WrongRoleError)
from node_agent.proto import agent_pb2, agent_pb2_grpc
from node_agent.trace import HEADER, STATE_HEADER, TraceContext, bind, from_metadata, new_trace
from node_agent.transfer import chunk_message

log = logging.getLogger(__name__)

SESSION_IDLE_CHECK_S = 1.0  # how often a session with no request open looks whether the agent drains
# A session's message holds at most this many tokens and top logprobs (about 12 bytes each, far below the
# 64 MiB message limit); what a writer that fell behind has beyond it goes out in the next messages.
MAX_BATCH_ENTRIES = 1 << 20

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


def request_failure(exc: EngineError | AgentError, request_id: str) -> tuple[grpc.StatusCode, str]:
    """The status a request that failed with `exc` ends with (a per-request call's or a session's), logged
    with its traceback when it is the agent's own fault (INTERNAL)."""
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("request %s failed", request_id)
    return code, str(exc)


@asynccontextmanager
async def grpc_errors(context: aio.ServicerContext, request_id: str):
    try:
        yield
    except (EngineError, AgentError) as exc:
        await context.abort(*request_failure(exc, request_id))


def _request_id(request_id: str, context: aio.ServicerContext) -> str:
    """The caller's id (field, else metadata) plus a suffix: an engine needs ids unique among its requests.
    Binds this RPC's task to the caller's id and trace (node_agent.trace)."""
    metadata = context.invocation_metadata() or ()
    return _bind(request_id or dict(metadata).get("x-request-id") or "anon", from_metadata(metadata))


def _bind(base: str, caller: TraceContext | None) -> str:
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


def embedding_bytes(vector, dimensions: int, normalized: bool) -> bytes:
    """The vector's first `dimensions` values (all for 0), re-normalized when the model normalizes, as
    little-endian float32."""
    if dimensions:
        vector = vector[:dimensions]
        if normalized:
            vector = vector / vector.norm().clamp_min(1e-12)
    return vector.float().numpy().astype("<f4").tobytes()


class AgentServicer(agent_pb2_grpc.AgentServicer):
    def __init__(self, core: AgentCore, on_drain: Callable[[float], None]):
        self.core = core
        self._on_drain = on_drain
        self.fetch_kv_hook: FetchKVHook | None = None
        self.sessions: set[SessionRelay] = set()
        self.stopping = False   # the agent stops: sessions take no new request and end once theirs are done

    def stop_sessions(self) -> None:
        """The agent is stopping: an idle session ends now (its router opens its next requests elsewhere)
        rather than holding the server's stop for its grace period, and the others take no new request and
        end when their requests are done, as per-request streams finish within the grace period."""
        self.stopping = True
        for relay in list(self.sessions):
            relay.notify()

    def generate_events(self, request: agent_pb2.GenerateRequest, request_id: str) -> AsyncIterator[TokenEvent]:
        """A Generate request's events, the per-request call's and a session's alike (admitted on the first read)."""
        return self.core.generate(request.model, list(request.prompt_ids), list(request.generated_ids),
                                  sampling_from_proto(request.sampling), request_id)

    def decode_events(self, request: agent_pb2.DecodeRequest, request_id: str,
                      time_left: float | None) -> AsyncIterator[TokenEvent]:
        source = None
        if request.HasField("kv_source") and request.kv_source.address:
            source = KVSource(request.kv_source.address, request.kv_source.kv_handle)
        return self.core.decode(request.model, list(request.prompt_ids), list(request.generated_ids),
                                sampling_from_proto(request.sampling), source, request_id, time_left)

    async def Generate(self, request: agent_pb2.GenerateRequest, context: aio.ServicerContext) -> None:
        request_id = _request_id(request.request_id, context)
        async with grpc_errors(context, request_id):
            await send_tokens(self.generate_events(request, request_id), context)

    async def Session(self, requests: AsyncIterator[agent_pb2.SessionRequest], context: aio.ServicerContext) -> None:
        await SessionRelay(self, context).run(requests)

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
        async with grpc_errors(context, request_id):
            await send_tokens(self.decode_events(request, request_id, context.time_remaining()), context)

    async def Embed(self, request: agent_pb2.EmbedRequest, context: aio.ServicerContext):
        """Every input runs as an engine request of its own, all at once (so they batch); admitted as one
        request is (the queue and the KV pool they need together), on a site that prefills."""
        request_id = _request_id(request.request_id, context)
        async with grpc_errors(context, request_id):
            core = self.core
            with core.inflight():
                inputs = [list(item.token_ids) for item in request.inputs]
                model, reservation = core.accept_embedding(request.model, inputs, request.dimensions)
                # The longest input, which the call was admitted on, starts on the admission's reservation: held
                # until then, no admission in between (these tasks run from the next turn) takes its blocks.
                longest = max(range(len(inputs)), key=lambda i: len(inputs[i]))
                with reservation:
                    tasks = [asyncio.ensure_future(model.engine.embed(
                        ids, f"{request_id}.{i}", reservation=reservation if i == longest else None))
                        for i, ids in enumerate(inputs)]
                    try:
                        events = await asyncio.gather(*tasks)
                    finally:
                        for task in tasks:   # the others, when one failed or the caller left: aborted in the engine
                            task.cancel()
            normalized = model.engine.engine.pooling.normalize
            for event in events:
                core.metrics.observe_prompt(model.name, event.num_prompt_tokens, event.num_cached_tokens)
            core.metrics.embeddings.labels(model.name).inc(len(events))
            log.info("embed %s: %d input(s), %d tokens (%d cached)", model.name, len(inputs),
                     sum(e.num_prompt_tokens for e in events), sum(e.num_cached_tokens for e in events))
            return agent_pb2.EmbedResponse(
                embeddings=[agent_pb2.Embedding(data=embedding_bytes(e.embedding, request.dimensions, normalized),
                                                num_prompt_tokens=e.num_prompt_tokens,
                                                num_cached_tokens=e.num_cached_tokens) for e in events],
                normalized=normalized)

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


class SessionRelay:
    """One Session stream. Each opened request runs in a task of its own through the servicer's
    `generate_events` / `decode_events`, as the per-request call does, and leaves its events here; the
    handler's task writes what every request left as one SessionBatch per wake-up. A request's events of
    one batch travel as one TokenChunk, split only where their prediction counts change (what `more`
    tells send_tokens: a message holds at most one step that verified proposals, its first).

    A cancel item, or the end of the session (the router left, or its side closed), cancels the request's
    task: leaving its event stream aborts the request in the engine and frees its KV, as a cancelled
    per-request stream does. A draining agent refuses new opens through admission (UNAVAILABLE, as
    Generate does), finishes the open ones, and ends the session once none is left."""

    def __init__(self, servicer: AgentServicer, context: aio.ServicerContext):
        self._servicer = servicer
        self._context = context
        self._loop = asyncio.get_running_loop()
        self._tasks: dict[int, asyncio.Task] = {}
        self._events: dict[int, list[TokenEvent]] = {}   # per request: events not yet written
        self._ended: dict[int, tuple[grpc.StatusCode, str] | None] = {}  # requests ended, not yet told: error or None
        self._wake: asyncio.Future | None = None
        self._closed = False   # the router's side ended: nothing more will be opened

    async def run(self, requests: AsyncIterator[agent_pb2.SessionRequest]) -> None:
        servicer = self._servicer
        metrics = servicer.core.metrics
        reader = asyncio.ensure_future(self._read(requests))
        servicer.sessions.add(self)
        metrics.sessions_open.inc()
        try:
            while True:
                if not self._events and not self._ended:
                    if self._closed or ((servicer.core.draining or servicer.stopping) and not self._tasks):
                        return
                    await self._sleep()
                    continue
                await self._context.write(self._batch())
                metrics.session_messages.inc()
        finally:
            metrics.sessions_open.dec()
            servicer.sessions.discard(self)
            reader.cancel()
            tasks = [reader, *self._tasks.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _sleep(self) -> None:
        self._wake = wake = self._loop.create_future()
        if self._tasks:
            await wake
            return
        try:  # nothing open: look again now and then whether the agent drains
            await asyncio.wait_for(wake, SESSION_IDLE_CHECK_S)
        except TimeoutError:
            pass

    def notify(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _read(self, requests: AsyncIterator[agent_pb2.SessionRequest]) -> None:
        try:
            async for message in requests:
                # A cancel for an id not open is for an open of this same message (its client left before
                # the open went out): that open is dropped. An open id is ended first, so it may be reused.
                dropped = {request_id for request_id in message.cancel if not self._cancel(request_id)}
                for item in message.open:
                    if item.id not in dropped:
                        self._open(item)
        finally:
            self._closed = True
            self.notify()

    def _open(self, item: agent_pb2.SessionOpen) -> None:
        if self._servicer.stopping:   # as the stopping server refuses a new per-request call
            self._end(item.id, (grpc.StatusCode.UNAVAILABLE, "the agent is stopping"))
            return
        if item.id in self._tasks:
            self._end(item.id, (grpc.StatusCode.INVALID_ARGUMENT, f"session request id {item.id} is already open; "
                                                                 "give each open request an id of its own"))
            return
        kind = item.WhichOneof("request")
        if kind is None:
            self._end(item.id, (grpc.StatusCode.INVALID_ARGUMENT, "a session open carries no request; set its "
                                                                 "generate or decode field"))
            return
        self._servicer.core.metrics.session_requests.labels(kind).inc()
        self._tasks[item.id] = asyncio.ensure_future(self._serve(item, kind))

    def _cancel(self, request_id: int) -> bool:
        """Whether the request was open (running, or ended and not yet told)."""
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()
        self._events.pop(request_id, None)
        told = request_id not in self._ended
        self._ended.pop(request_id, None)
        return task is not None or not told

    async def _serve(self, item: agent_pb2.SessionOpen, kind: str) -> None:
        """One opened request, on a task of its own (bound to its request id and trace, as an RPC's is)."""
        session_id = item.id
        request = getattr(item, kind)
        caller = from_metadata(((HEADER, item.traceparent), (STATE_HEADER, item.tracestate))) \
            if item.traceparent else None
        request_id = _bind(request.request_id or "anon", caller)
        time_left = item.timeout_s if item.timeout_s > 0 else None
        deadline = asyncio.timeout(time_left)
        error = None
        try:
            async with deadline:
                if kind == "generate":
                    events = self._servicer.generate_events(request, request_id)
                else:
                    events = self._servicer.decode_events(request, request_id, time_left)
                async with aclosing(events):  # leaving early must reach the engine's abort now
                    async for event in events:
                        pending = self._events.get(session_id)
                        if pending is None:
                            self._events[session_id] = [event]
                            self.notify()
                        else:
                            pending.append(event)
        except (EngineError, AgentError) as exc:
            error = request_failure(exc, request_id)
        except TimeoutError as exc:
            if deadline.expired():
                error = (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            else:  # not its deadline: failed as the other unexpected errors below, never left unanswered
                log.exception("request %s failed", request_id)
                error = (grpc.StatusCode.UNKNOWN, f"Unexpected error: {exc!r}")
        except Exception as exc:  # what gRPC would end the per-request call with (UNKNOWN), logged once
            log.exception("request %s failed", request_id)
            error = (grpc.StatusCode.UNKNOWN, f"Unexpected error: {exc!r}")
        if self._tasks.pop(session_id, None) is not None:  # not cancelled meanwhile
            self._end(session_id, error)

    def _end(self, session_id: int, error: tuple[grpc.StatusCode, str] | None) -> None:
        self._ended[session_id] = error
        self.notify()

    def _fail(self, session_id: int, exc: Exception) -> None:
        """A request whose tokens could not be written: ended with UNKNOWN (as gRPC ends a per-request call
        whose handler raised), its task cancelled (which aborts it in the engine and frees its KV) and what
        it still held dropped."""
        log.error("session request %s: its tokens could not be written", session_id, exc_info=exc)
        task = self._tasks.pop(session_id, None)
        if task is not None:
            task.cancel()
        self._events.pop(session_id, None)
        self._end(session_id, (grpc.StatusCode.UNKNOWN, f"Unexpected error: {exc!r}"))

    def _batch(self) -> agent_pb2.SessionBatch:
        """What was made since the last batch, as one message: all of it unless a writer that fell behind
        holds more than MAX_BATCH_ENTRIES tokens and top logprobs, whose rest (and the ends that follow
        it) stays for the next message, in order."""
        events, self._events = self._events, {}
        ended, self._ended = self._ended, {}
        batch = agent_pb2.SessionBatch()
        items = batch.items
        budget = MAX_BATCH_ENTRIES
        for session_id, held in events.items():
            if budget <= 0:
                self._events[session_id] = held
                continue
            taken = 0
            while taken < len(held) and budget > 0:
                budget -= 1 + len(held[taken].top_logprobs or ())
                taken += 1
            if taken < len(held):
                self._events[session_id], held = held[taken:], held[:taken]
            first = len(items)
            try:
                start = 0
                for end in range(1, len(held) + 1):
                    if end == len(held) or prediction_counts(held[end]) != prediction_counts(held[end - 1]):
                        item = items.add(id=session_id)
                        token_chunk(held[start:end], item.chunk)
                        start = end
            except Exception as exc:  # this request's tokens cannot be written: it alone fails, the session goes on
                del items[first:]
                self._fail(session_id, exc)
                ended[session_id] = self._ended.pop(session_id)
                continue
            if session_id not in self._events and session_id in ended and ended[session_id] is None:
                del ended[session_id]
                item.finished = True
        for session_id, error in ended.items():
            if session_id in self._events:   # told after the tokens still to go
                self._ended[session_id] = error
                continue
            item = items.add(id=session_id, finished=True)
            if error is not None:
                item.error.code, item.error.message = error[0].value[0], error[1]
        return batch
