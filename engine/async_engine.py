"""The asyncio front of the engine: the step loop on its own thread, results streamed to coroutines.

Callers never touch LLMEngine directly; every mutation is handed to the engine thread as a
command, so the engine stays single-threaded. `generate` is an async iterator of TokenEvent;
leaving it early (break, cancellation, a client that went away) aborts the request and frees
its blocks. `embed` is one embedding request: its pooled vector, or the error. A command waits for
the step in progress, which can be a long prefill chunk, so
`latest_stats` (refreshed by the engine thread after every step and command) answers admission
checks without that wait; `admission_figures` adds what those stats do not count yet: the `Reservation`s
admission made, each held from the admission until the stats count the request started on it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.engine import EngineStats, LLMEngine, StepOutput
from engine.errors import EngineError, UnknownHandleError
from engine.kv_export import KVExport
from engine.kv_transfer import KVChunk, KVPayload
from engine.sampling import SamplingParams

log = logging.getLogger(__name__)

# How often an idle engine thread wakes to expire KV handles.
IDLE_WAKE_S = 0.5


@dataclass(slots=True)
class TokenEvent:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None     # set on the last event: stop | length
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_handle: str | None = None  # prefill-only requests: the handle of the pinned KV
    # Another event of this request was already waiting when this one was read (a speculative step's
    # accepted tokens, or a reader that fell behind): the next read returns at once, so a reader may
    # hold this one back and pass both on together. Never set before an event whose prediction counts
    # differ: a message then holds at most one step whose proposals from the prediction were verified,
    # its first, so the proposals it kept are the message's first tokens (a consumer that cuts the
    # answer inside a message knows which of them it kept, router/generation.py).
    more: bool = False
    num_accepted_prediction_tokens: int = 0  # running totals of the request's predicted-output proposals
    num_rejected_prediction_tokens: int = 0


@dataclass(slots=True)
class EmbeddingEvent:
    """An embedding request's outcome: its pooled vector (float32, on the CPU)."""

    embedding: torch.Tensor
    num_prompt_tokens: int
    num_cached_tokens: int


class EngineDeadError(EngineError):
    """The engine thread stopped (shut down or crashed); no request can be served."""


class Reservation:
    """The KV blocks an admission let one request count on (its size less the prefix blocks it shares), held
    from the admission until the engine's stats count the request: in between (a decode pulling its KV, the
    hop to the engine thread) the request is in no stats, and admissions meanwhile must not hand out its blocks.
    A request started with it takes it over (`started`; cleared by the stats that count that request); one
    whose start fails gives it back to its holder, which may start another on it (a refused KV import's
    recompute). `release` (or leaving `with reservation:`) ends one no request holds; a no-op otherwise."""

    __slots__ = ("num_blocks", "started", "_engine")

    def __init__(self, engine: AsyncEngine, num_blocks: int):
        self.num_blocks = num_blocks
        self.started = False
        self._engine = engine

    def release(self) -> None:
        self._engine._release(self)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


class AdmissionFigures(NamedTuple):
    """What admission adds to `stats` (those of the last step): the reservations they do not count yet."""

    stats: EngineStats
    num_pending: int          # requests handed to the engine thread: waiting, for admission
    num_pending_blocks: int   # KV blocks of every reservation, handed over or not
    num_reserved: int         # reservations not handed over yet (a decode pulling its KV): held sequences


class _Inbox:
    """One stream's undelivered items and its reader's wake-up: a deque and at most one future, made only
    when the reader finds the deque empty. Lighter than an asyncio.Queue, which makes and queues a
    future per get and looks up its loop per call, for a relay that runs once per token of every stream."""

    __slots__ = ("loop", "items", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        """On the event loop."""
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        """Until an item is in (call with none in). A reader cancelled here leaves a cancelled waiter,
        which the next put passes over."""
        self.waiter = self.loop.create_future()
        await self.waiter


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: list[Callable[[], None]] = []
        self._cond = threading.Condition()
        self._streams: dict[str, _Inbox] = {}
        # request id -> the KV handle of its prefill, sent to its stream and not read yet: if the stream is
        # left first (a cancelled Prefill), no one else knows the handle, so the engine thread releases it
        self._unread_leases: dict[str, str] = {}
        # admission reads the stats of the last step, so without these a burst arriving within one step,
        # or while decodes pull their KV, would all see the same queue and the same free blocks
        self._reservations: set[Reservation] = set()
        self._pending_lock = threading.Lock()
        self._added: list[Reservation] = []  # engine thread: those of requests added since the last stats
        # calls waiting for the engine thread's answer: failed at once if it stops or crashes before it ran them
        self._calls: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()
        self._calls_lock = threading.Lock()
        self._stopped = False
        self._error: BaseException | None = None
        self.latest_stats: EngineStats = engine.stats()
        self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)
        self._thread.start()

    # -- engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopped and not self._commands and not self.engine.has_work():
                        self._cond.wait(IDLE_WAKE_S)
                        self.engine.check_ranks()  # a parallel engine's dead rank ends this loop while idle too
                        if self.engine.expire_handles():
                            self._refresh_stats()
                    if self._stopped:
                        return
                    commands, self._commands = self._commands, []
                for command in commands:
                    command()
                if commands:
                    self._refresh_stats()  # aborts and releases free blocks without a step
                if self.engine.has_work():
                    outputs = self.engine.step()
                    self._refresh_stats()  # before any caller hears of this step
                    self._dispatch(outputs)
        except BaseException as exc:  # the thread must report any crash to every waiter
            log.exception("engine step loop crashed")
            self._error = exc
            for inbox in list(self._streams.values()):
                inbox.loop.call_soon_threadsafe(inbox.put, EngineDeadError(f"engine crashed: {exc!r}"))
        finally:
            self._fail_calls()

    def _fail_calls(self) -> None:
        """The calls queued when the thread ended never run: their callers (a heartbeat's stats, a metrics
        scrape, an abort) would wait forever, and an agent waiting on one would never stop."""
        reason = f"engine crashed: {self._error!r}" if self._error is not None else "engine is not running"
        with self._calls_lock:
            calls, self._calls = self._calls, set()
        for loop, future in calls:
            loop.call_soon_threadsafe(_settle, future, None, EngineDeadError(reason))

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        """Hands a step's tokens to their streams: one wake-up of each event loop per step, not one per
        token (a wake-up is a write to the loop's self-pipe; a step of a few hundred sequences made as
        many system calls and loop callbacks)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            inbox = self._streams.get(out.request_id)
            if inbox is None:
                if out.kv_handle:  # its caller left while the prefill ran: no one will fetch or release it
                    self._release_abandoned(out.request_id, out.kv_handle)
                continue
            if out.kv_handle:
                self._unread_leases[out.request_id] = out.kv_handle
            if out.finished:
                self._streams.pop(out.request_id, None)
            if out.embedding is not None:
                event = EmbeddingEvent(out.embedding, out.num_prompt_tokens, out.num_cached_tokens)
                batches.setdefault(inbox.loop, []).append((inbox, (event, True)))
                continue
            event = TokenEvent(out.token.token_id, out.token.logprob, out.token.top_logprobs, out.finish_reason,
                               out.num_prompt_tokens, out.num_cached_tokens, out.kv_handle,
                               num_accepted_prediction_tokens=out.num_accepted_prediction_tokens,
                               num_rejected_prediction_tokens=out.num_rejected_prediction_tokens)
            batches.setdefault(inbox.loop, []).append((inbox, (event, out.finished)))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _refresh_stats(self) -> None:
        """New stats, and the reservations of requests added since the last ones end in the same move: a
        request counted by the stats and still reserved was counted twice (each add's command refreshes the
        stats, so a burst being added counted its added part twice)."""
        stats = self.engine.stats()
        with self._pending_lock:
            self.latest_stats = stats  # one reference swap: readers on other threads see a whole object
            self._reservations.difference_update(self._added)
        self._added.clear()

    def shared_prefix_blocks(self, token_ids: list[int]) -> tuple[int, int]:
        """Leading blocks of these tokens that running sequences hold in the prefix cache
        (BlockManager.shared_prefix_blocks): a request with them needs that many fewer free blocks; and the
        free blocks now. Both are read live: a step in progress may have taken cached blocks that
        latest_stats still counts free, and a block must not count as free and as shared at once."""
        manager = self.engine.block_manager
        return manager.shared_prefix_blocks(token_ids), manager.num_free_blocks

    @property
    def watermark_blocks(self) -> int:
        """Blocks the engine leaves free when it admits a waiting request or imports KV beside running ones
        (SchedulerConfig.watermark_blocks): admission keeps them out of what it hands out."""
        return self.engine.scheduler.config.watermark_blocks

    def admission_figures(self) -> AdmissionFigures:
        """latest_stats and the reservations those stats do not count, read together: an admission check adds
        the handed-over ones to the stats' waiting requests and subtracts every one's blocks from its free
        blocks."""
        with self._pending_lock:
            num_pending = sum(reservation.started for reservation in self._reservations)
            return AdmissionFigures(self.latest_stats, num_pending,
                                    sum(reservation.num_blocks for reservation in self._reservations),
                                    len(self._reservations) - num_pending)

    def reserve(self, num_blocks: int) -> Reservation:
        """Holds num_blocks for a request admitted now (on the event loop, in the same turn as the check)."""
        reservation = Reservation(self, num_blocks)
        with self._pending_lock:
            self._reservations.add(reservation)
        return reservation

    def _release(self, reservation: Reservation) -> None:
        with self._pending_lock:
            if not reservation.started:
                self._reservations.discard(reservation)

    def _hand_over(self, reservation: Reservation, started: bool) -> None:
        """Into (started) or back out of a request's start (failed); held until the stats or its holder end it."""
        with self._pending_lock:
            reservation.started = started
            self._reservations.add(reservation)  # again, when the stats that counted an earlier start ended it

    def _submit(self, command: Callable[[], None]) -> None:
        if self._error is not None or self._stopped:
            raise EngineDeadError("engine is not running")
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    async def call(self, fn: Callable[[LLMEngine], object]):
        """Run fn(engine) on the engine thread and return its result (exceptions propagate)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        waiting = (loop, future)
        with self._calls_lock:  # before the dead-engine check in _submit: a call is either failed or refused
            self._calls.add(waiting)

        def command() -> None:
            with self._calls_lock:
                self._calls.discard(waiting)
            try:
                result = fn(self.engine)
            except Exception as exc:
                self._refresh_stats()
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                self._refresh_stats()
                loop.call_soon_threadsafe(_settle, future, result, None)

        try:
            self._submit(command)
        except EngineDeadError:
            with self._calls_lock:
                self._calls.discard(waiting)
            raise
        return await future

    # -- requests ----------------------------------------------------------------------------

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                 generated_ids: list[int] | None = None, prefill_only: bool = False,
                 reservation: Reservation | None = None) -> AsyncIterator[TokenEvent]:
        """The request's events; it starts on `reservation` (the admission's) when given, else on one of its size."""
        request_id = request_id or uuid.uuid4().hex
        return self._stream(request_id, lambda e: e.add_request(request_id, prompt_ids, params, generated_ids,
                                                                prefill_only),
                            len(prompt_ids) + len(generated_ids or ()), reservation)

    def generate_from_kv(self, payload: KVPayload, params: SamplingParams, generated_ids: list[int],
                         request_id: str | None = None,
                         reservation: Reservation | None = None) -> AsyncIterator[TokenEvent]:
        """Decode a request whose prompt was prefilled elsewhere (payload from export_kv)."""
        request_id = request_id or uuid.uuid4().hex
        return self._stream(request_id, lambda e: e.import_kv(request_id, payload, params, generated_ids),
                            len(payload.token_ids) + len(generated_ids), reservation)

    async def prefill(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                      reservation: Reservation | None = None) -> TokenEvent:
        """Prefill only: the first token, with kv_handle naming the pinned KV (release or let it expire)."""
        event = None
        async with aclosing(self.generate(prompt_ids, params, request_id, prefill_only=True,
                                          reservation=reservation)) as events:
            async for event in events:
                pass
        return event

    async def embed(self, prompt_ids: list[int], request_id: str | None = None,
                    reservation: Reservation | None = None) -> EmbeddingEvent:
        """One embedding request (LLMEngine.add_embedding_request), started on `reservation` (an admission's) when
        given, else on one of its size. Cancelling the wait aborts it."""
        request_id = request_id or uuid.uuid4().hex
        inbox = await self._start(request_id, lambda e: e.add_embedding_request(request_id, prompt_ids),
                                  len(prompt_ids), num_new_tokens=0, reservation=reservation)
        finished = False
        try:
            while not inbox.items:
                await inbox.wait()
            item = inbox.items.popleft()
            if isinstance(item, BaseException):
                raise item
            finished = True
            return item[0]
        finally:
            if not finished:
                self._streams.pop(request_id, None)
                if self._error is None and not self._stopped:
                    self._submit(lambda: self.engine.abort(request_id))

    async def _start(self, request_id: str, add: Callable[[LLMEngine], None], num_tokens: int,
                     num_new_tokens: int = 1, reservation: Reservation | None = None) -> _Inbox:
        # The stream is registered before the request exists, so no token can miss it; a
        # request that finishes in its first step unregisters itself before we read it back.
        # Without an admission's reservation it reserves its tokens and the first it generates (an
        # embedding generates none).
        inbox = _Inbox(asyncio.get_running_loop())
        self._streams[request_id] = inbox
        own = reservation is None
        if own:
            reservation = Reservation(self, -(-(num_tokens + num_new_tokens) // self.engine.config.block_size))
        self._hand_over(reservation, started=True)

        def added(engine: LLMEngine) -> None:
            try:
                add(engine)
            except BaseException:
                # an add that failed part way (an import whose KV write failed after its blocks were taken) left
                # a sequence no stream reads and nothing ends: its blocks would stay taken for good
                engine.abort(request_id)
                raise
            self._added.append(reservation)  # the next stats count the request

        try:
            await self.call(added)
        except BaseException as exc:
            self._streams.pop(request_id, None)
            if not isinstance(exc, asyncio.CancelledError):  # the add ran and failed, or never will run
                if own:
                    with self._pending_lock:
                        self._reservations.discard(reservation)
                else:
                    self._hand_over(reservation, started=False)  # back to its holder
            elif self._error is None and not self._stopped:
                # the engine thread adds the request all the same; this command, queued behind it, ends it
                self._submit(lambda: self._abort_start(request_id, reservation))
            raise
        return inbox

    def _abort_start(self, request_id: str, reservation: Reservation) -> None:
        """On the engine thread, after the add of a request whose start was cancelled: abort it (and end the
        lease of a prefill that finished meanwhile, as for any stream left early), and end its reservation
        whether the add went through or failed (its holder has left)."""
        self._added.append(reservation)
        self._abandon(request_id)

    async def _stream(self, request_id: str, add: Callable[[LLMEngine], None], num_tokens: int,
                      reservation: Reservation | None) -> AsyncIterator[TokenEvent]:
        """The request's events, added and read in this one generator: each layer of generators between
        the engine and a gRPC stream costs every token of every stream a resumption."""
        inbox = await self._start(request_id, add, num_tokens, reservation=reservation)
        items = inbox.items
        finished = False
        try:
            while not finished:
                while not items:
                    await inbox.wait()
                item = items.popleft()
                if isinstance(item, BaseException):
                    raise item
                event, finished = item
                if event.kv_handle:
                    self._unread_leases.pop(request_id, None)  # the caller holds the lease now
                event.more = bool(items) and not _prediction_counted(event, items[0])
                yield event
        finally:
            if not finished:
                self._streams.pop(request_id, None)
                if self._error is None and not self._stopped:
                    self._submit(lambda: self._abandon(request_id))

    def _abandon(self, request_id: str) -> None:
        """On the engine thread, for a stream left before its end: abort the request, and end the lease
        of a prefill that finished meanwhile (its event, with the handle, was never read)."""
        self.engine.abort(request_id)
        kv_handle = self._unread_leases.pop(request_id, None)
        if kv_handle is not None:
            self._release_abandoned(request_id, kv_handle)

    def _release_abandoned(self, request_id: str, kv_handle: str) -> None:
        log.info("request %s: left before its prefill's KV handle was read; releasing its lease", request_id)
        try:
            self.engine.release_kv(kv_handle)
        except UnknownHandleError:
            pass  # expired meanwhile: the outcome asked for

    async def prepare_grammar(self, spec) -> None:
        """Compile a request's grammar on a worker thread (InvalidRequestError when it does not compile), so the
        step loop only ever finds it cached."""
        await asyncio.to_thread(self.engine.prepare_grammar, spec)

    async def export_kv(self, handle: str) -> KVPayload:
        return await self.call(lambda e: e.export_kv(handle))

    async def open_export(self, handle: str) -> KVExport:
        """Hold a KV handle open for reading (read with `kv_chunks`); always close_export it.

        Opened here, not on the engine thread: a pull starts at once, whatever step is running."""
        if self._error is not None or self._stopped:
            raise EngineDeadError("engine is not running")
        return self.engine.open_export(handle)

    def close_export(self, export: KVExport) -> None:
        # not awaited: this must run even when the caller is being cancelled
        if self._error is None and not self._stopped:
            self._submit(lambda: self.engine.close_export(export))

    async def release_kv(self, handle: str) -> None:
        await self.call(lambda e: e.release_kv(handle))

    def release_kv_nowait(self, handle: str) -> None:
        """Queue a release behind every command already submitted (safe from a cancelled task); the
        handle opens no export from this call on, though its blocks are freed only when the release runs."""
        self.engine.end_lease(handle)

        def release() -> None:
            try:
                self.engine.release_kv(handle)
            except UnknownHandleError:
                pass  # already released or expired: the outcome asked for
        if self._error is None and not self._stopped:
            self._submit(release)

    async def abort(self, request_id: str) -> bool:
        return await self.call(lambda e: e.abort(request_id))

    async def stats(self) -> EngineStats:
        return await self.call(lambda e: e.stats())

    async def cache_summary(self, max_hashes: int = 4096) -> dict:
        return await self.call(lambda e: e.cache_summary(max_hashes))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def error(self) -> BaseException | None:
        """Why the engine thread stopped, when it crashed."""
        return self._error

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=10)
        self.engine.shutdown()


async def kv_chunks(export: KVExport) -> AsyncIterator[KVChunk]:
    """An export's chunks, each gathered on a worker thread while the previous one is consumed."""
    chunks = export.chunks()
    pending = asyncio.ensure_future(asyncio.to_thread(next, chunks, None))
    try:
        while (chunk := await pending) is not None:
            pending = asyncio.ensure_future(asyncio.to_thread(next, chunks, None))
            yield chunk
    finally:
        if not pending.done():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)


def prediction_counts(event: TokenEvent) -> tuple[int, int]:
    """The request's running (accepted, rejected) prediction counts as of this event: a message of its events
    never spans a change of them (TokenEvent.more)."""
    return event.num_accepted_prediction_tokens, event.num_rejected_prediction_tokens


def _prediction_counted(event: TokenEvent, following) -> bool:
    """Whether the step of the event that follows verified proposals from the request's prediction."""
    return isinstance(following, tuple) and prediction_counts(following[0]) != prediction_counts(event)


def _deliver(items: list) -> None:
    for inbox, item in items:
        inbox.put(item)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
