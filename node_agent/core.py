"""What an agent does, with no gRPC server in sight: admit requests, run them on the engines,
lease prefilled KV, pull KV from peers (recomputing when that fails), and drain.

Handles given out are `<model>/<engine handle>`, so FetchKV and ReleaseKV find the engine that
holds the blocks. A lease is single use: the FetchKV stream (or KV data-port stream) that reads
it releases it when the stream ends, however it ends; otherwise ReleaseKV or the engine's TTL does.
A caller that gives up on a Prefill (its client left, a timeout) may do so after this agent answered,
so it never learns the handle: it releases by the lease id it chose for that Prefill (`LeaseIds`).
A decode site whose pull fails before it read the lease releases it too, since it recomputes instead.

Each request is logged when it starts and ends (INFO); the lines end with the request id and trace
id the caller sent (node_agent.trace), and a lease's export is logged under the trace of the
Prefill that made it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, replace

from grpc import aio

from engine.async_engine import Reservation, TokenEvent
from engine.errors import InvalidRequestError, KVTransferError, UnknownHandleError
from engine.kv_export import KVExport
from engine.kv_transfer import KVLayout, KVPayload
from engine.sampling import SamplingParams
from node_agent.client import AgentClient, AgentPool
from node_agent.config import AgentConfig
from node_agent.errors import (DrainingError, LeaseReleasedError, OverloadedError, UnknownModelError,
                               WrongRoleError)
from node_agent.metrics import AgentMetrics
from node_agent.kv_data import KVDataServer, KVSourceUnreachable, probe, receive_bulk
from node_agent.links import LinkTable
from node_agent.models import HostedModel
from node_agent.tls import channel_credentials, client_context
from node_agent.trace import LeaseTraces, current
from node_agent.transfer import receive_payload

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0
RELEASE_TIMEOUT_S = 5.0      # a decode site's release of a lease it did not read
MAX_LEASE_ID_CHARS = 128
MAX_LEASE_IDS = 100_000      # per kind of entry; far above leases made within one TTL at any real rate


@dataclass(slots=True)
class KVSource:
    address: str
    kv_handle: str


@dataclass(slots=True)
class Peer:
    """What a peer's Health said once: its site name and its KV data port (host:port), if any."""

    site: str
    data_address: str | None


class LeaseIds:
    """Caller-chosen lease ids (PrefillRequest.lease_id): the handle each one's Prefill leased, and the
    ids released before their Prefill leased anything, so that lease ends the moment it is made (a
    release may overtake its Prefill: they are separate calls). Entries are kept for `ttl_s`, the lease
    TTL: by then a lease has ended on its own, and a Prefill's caller has long stopped waiting for it."""

    def __init__(self, ttl_s: float, max_entries: int = MAX_LEASE_IDS) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._handles: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (leased at, kv handle)
        self._released: OrderedDict[str, float] = OrderedDict()             # id -> released at

    def is_released(self, lease_id: str) -> bool:
        self._prune()
        return lease_id in self._released

    def leased(self, lease_id: str, kv_handle: str) -> bool:
        """Records the handle a Prefill leased; False when its id was released first (end it now)."""
        if self.is_released(lease_id):
            return False
        self._remember(self._handles, lease_id, (time.monotonic(), kv_handle))
        return True

    def release(self, lease_id: str) -> str | None:
        """The handle leased under this id (forgotten now); None when its Prefill has leased nothing
        yet, and the id is remembered as released for when it does."""
        self._prune()
        entry = self._handles.pop(lease_id, None)
        if entry is not None:
            return entry[1]
        self._remember(self._released, lease_id, time.monotonic())
        return None

    def _remember(self, entries: OrderedDict, lease_id: str, value) -> None:
        entries[lease_id] = value
        entries.move_to_end(lease_id)  # oldest first, so pruning stops at the first fresh entry
        if len(entries) > self._max_entries:
            entries.popitem(last=False)

    def _prune(self) -> None:
        oldest = time.monotonic() - self._ttl_s
        while self._handles and next(iter(self._handles.values()))[0] < oldest:
            self._handles.popitem(last=False)
        while self._released and next(iter(self._released.values())) < oldest:
            self._released.popitem(last=False)


@dataclass(slots=True)
class PrefillOutcome:
    first: TokenEvent
    kv_handle: str          # "" when the request finished at its first token
    kv_bytes: int
    kv_layout_json: str


class AgentCore:
    def __init__(self, config: AgentConfig, models: dict[str, HostedModel], metrics: AgentMetrics):
        self.config = config
        self.models = models
        self.metrics = metrics
        self.draining = False
        self.active_role: str | None = None  # the pool planner's pick (registry.planner); None: as configured
        self.num_inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        tls = (config.tls_ca, config.tls_cert, config.tls_key)
        self._peers = AgentPool(config.peer_token, channel_credentials(*tls) if config.peers_over_tls else None)
        self._peer_ssl = client_context(*tls) if config.peers_over_tls else None  # for peers' KV data ports
        self.kv_data_server: KVDataServer | None = None  # set by the daemon when the data port is on
        self._peer_info: dict[str, Peer] = {}  # peer gRPC address -> its Health answer
        self.links = LinkTable()  # measured paths to peer sites (node_agent.links)
        self.lease_traces = LeaseTraces()  # the request each open lease was made for (its export's logs)
        self.lease_ids = LeaseIds(config.kv_lease_ttl_s)
        self._releases: set[asyncio.Task] = set()  # releases of leases a failed pull never read

    # -- admission ---------------------------------------------------------------------------

    def model(self, name: str) -> HostedModel:
        hosted = self.models.get(name)
        if hosted is None:
            raise UnknownModelError(f"model {name!r} is not served here (this agent serves {', '.join(self.models)})")
        return hosted

    @property
    def role(self) -> str:
        """The role new work is taken for: the configured one, narrowed by the pool planner's pick."""
        if self.config.role == "both" and self.active_role in ("prefill", "decode"):
            return self.active_role
        return self.config.role

    def set_active_role(self, active_role: str | None) -> None:
        """The registry's answer names the planner's pick; requests already admitted run to the end."""
        if active_role != self.active_role:
            log.info("active role now %s (configured: %s)", active_role or "both", self.config.role)
            self.active_role = active_role

    def _check_role(self, step: str) -> None:
        if self.role != "both" and self.role != step:
            raise WrongRoleError(f"this site's role is {self.role}; it does not {step}")

    def _validate(self, model: HostedModel, prompt_ids: list[int], generated_ids: list[int],
                  params: SamplingParams) -> None:
        """Bad input is refused here, before it costs an engine round trip."""
        if not prompt_ids:
            raise InvalidRequestError("prompt_ids is empty; send at least one token")
        params.validate(model.vocab_size)
        bad = next((t for t in (*prompt_ids, *generated_ids) if t >= model.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary (size {model.vocab_size})")
        total = len(prompt_ids) + len(generated_ids)
        if total >= model.info.context_length:
            raise InvalidRequestError(f"prompt and generated tokens number {total}; the context holds "
                                      f"{model.info.context_length} including at least one new token")

    def _admit(self, model: HostedModel, num_tokens: int, takes_slot: bool = False, generates: bool = True,
               token_ids: list[int] | None = None) -> Reservation:
        """Refuses work the site cannot take now (RESOURCE_EXHAUSTED: the router moves on), or reserves the KV
        blocks it admitted the request on. Its KV must hold num_tokens and, when it `generates`, the first new
        token (an embedding generates none), less the leading blocks of `token_ids` that running sequences hold
        in the prefix cache: a request with a hot shared prefix (a long system prompt many requests run with)
        shares those blocks instead of taking free ones. They are looked up only when the free blocks would not
        hold the whole request (hashing a long prompt costs).

        The free blocks it can have are those the engine's stats count free less those claimed already: the
        blocks the engine's waiting requests will take once scheduled (`num_blocks_waiting`: a queued request
        takes its blocks only then, so without this a burst of long prompts would be admitted on the same free
        blocks and queue here, or churn through preemption, instead of going to a site with room), and the
        engine's watermark, which it keeps free when it admits a request or imports KV beside others: a request
        that leaves less would wait in the queue too. The engine admits on the blocks of the request's tokens
        plus the watermark, so a first generated token that opens a block of its own is counted in the
        watermark, not beside it; and alone on an idle engine a request may fill the pool, as the context
        (capped at the pool's size) allows.

        The engine's stats are those of its last step (no wait for the step in progress); the reservations of
        requests admitted since, which those stats do not count yet, count as waiting requests (once handed to
        the engine thread) and take their blocks from the free ones. The returned reservation holds the blocks
        this check counted (the request's size less the credited prefix) from now on: through a decode's KV
        pull and the hop to the engine thread, until the stats count the request started on it (the engine's
        generate, prefill and generate_from_kv take it over). Its holder leaves `with reservation:` on every
        exit, which gives it back unless a request took it over. Check and reservation are one synchronous
        step on the event loop: concurrent admissions see each other's blocks.

        `takes_slot` (Decode): the sequence must run at once, so the site must hold fewer than `max_num_seqs`
        sequences, counting admitted requests not handed to the engine yet (decodes pulling their KV).
        """
        if self.draining:
            raise DrainingError("this agent is draining and takes no new work; use another site")
        stats, pending, pending_blocks, reserved = model.engine.admission_figures()
        waiting = stats.num_waiting + pending
        if takes_slot:
            held = stats.num_running + waiting + reserved
            if held >= self.config.max_num_seqs:
                self.metrics.rejected.labels("seqs").inc()
                raise OverloadedError(f"decode slots are full: {held} sequences held, max_num_seqs is "
                                      f"{self.config.max_num_seqs}")
        if waiting >= self.config.max_waiting:
            self.metrics.rejected.labels("queue").inc()
            raise OverloadedError(f"queue is full ({waiting} waiting, limit {self.config.max_waiting})")
        needed = model.blocks_needed(num_tokens + (1 if generates else 0))
        queued = stats.num_blocks_waiting + pending_blocks
        kept = model.engine.watermark_blocks if stats.num_running + waiting + reserved else 0
        kept = max(kept - (needed - model.blocks_needed(num_tokens)), 0)  # a first token opening a block takes it
        free = stats.num_blocks_free - queued - kept
        if needed > free and token_ids is not None:
            shared, free_now = model.engine.shared_prefix_blocks(token_ids)
            needed -= shared
            free = min(free, free_now - queued - kept)  # the shared blocks are live: so is the room beside them
        if needed > free:
            self.metrics.rejected.labels("kv").inc()
            claimed = [f"queued requests will take {queued} as they start"] if queued else []
            claimed += [f"{kept} is kept free for running sequences to grow"] if kept else []
            raise OverloadedError(f"KV pool is full: the request needs {needed} blocks, {max(free, 0)} of "
                                  f"{stats.num_blocks_total} are free for it"
                                  + (f" ({' and '.join(claimed)})" if claimed else ""))
        return model.engine.reserve(needed)

    async def _accept(self, model_name: str, step: str, prompt_ids: list[int], generated_ids: list[int],
                      params: SamplingParams, takes_slot: bool = False) -> tuple[HostedModel, Reservation]:
        """The model, and the reservation the request was admitted on (see _admit: hold it `with`)."""
        model = self.model(model_name)
        self._check_role(step)
        self._validate(model, prompt_ids, generated_ids, params)
        if params.grammar is not None:  # compiled off the engine thread: a large schema never stalls a step
            await model.engine.prepare_grammar(params.grammar)
        reservation = self._admit(model, len(prompt_ids) + len(generated_ids), takes_slot,
                                  token_ids=prompt_ids + generated_ids if generated_ids else prompt_ids)
        return model, reservation

    def accept_embedding(self, model_name: str, inputs: list[list[int]],
                         dimensions: int) -> tuple[HostedModel, Reservation]:
        """The model an Embed call runs on and the reservation it was admitted on, once the call is checked
        (check_embed_request) and admitted on a site that prefills: when the queue has room and the KV free now
        holds its longest input. Its inputs then queue in the engine together and run as blocks allow (each one's
        KV is freed once it is pooled), so a call larger than the whole pool is served, as that many prompts sent
        at once would be. The longest input's engine request starts on the reservation (the others each on one of
        their own); its holder leaves `with reservation:` on every exit, as for the other requests."""
        model = self.model(model_name)
        self._check_role("prefill")
        engine = model.engine.engine
        check_embed_request(inputs, dimensions, model.vocab_size, model.info.context_length,
                            engine.model_config.hidden_size, engine.pooling_error)
        return model, self._admit(model, max(len(ids) for ids in inputs), generates=False)

    @contextmanager
    def inflight(self):
        """Counts a request for drain; drain waits until none are left."""
        self.num_inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.num_inflight -= 1
            if not self.num_inflight:
                self._idle.set()

    # -- requests ----------------------------------------------------------------------------

    async def generate(self, model_name: str, prompt_ids: list[int], generated_ids: list[int],
                       params: SamplingParams, request_id: str | None = None) -> AsyncIterator[TokenEvent]:
        with self.inflight():
            model, reservation = await self._accept(model_name, "decode", prompt_ids, generated_ids, params)
            log.info("generate %s: %d prompt + %d generated tokens, up to %d in all", model.name, len(prompt_ids),
                     len(generated_ids), params.max_tokens)
            events = model.engine.generate(prompt_ids, params, request_id, generated_ids, reservation=reservation)
            with reservation, _Observed(self.metrics, model.name, "generate", prefills=True) as observed:
                async with aclosing(events):  # leaving early must reach the engine's abort now, not at GC
                    async for event in events:
                        observed.token(event)
                        yield event

    async def prefill(self, model_name: str, prompt_ids: list[int], params: SamplingParams,
                      request_id: str | None = None, lease_id: str = "") -> PrefillOutcome:
        _check_lease_id(lease_id)
        if lease_id and self.lease_ids.is_released(lease_id):
            raise LeaseReleasedError(f"lease id {lease_id!r} was released before this Prefill ran; its caller "
                                     "has given up on it")
        with self.inflight():
            model, reservation = await self._accept(model_name, "prefill", prompt_ids, [], params)
            started = time.perf_counter()
            with reservation:
                event = await model.engine.prefill(prompt_ids, params, request_id, reservation)
            self.metrics.ttft.labels(model.name, "prefill").observe(time.perf_counter() - started)
            self.metrics.observe_prompt(model.name, event.num_prompt_tokens, event.num_cached_tokens)
            seconds = time.perf_counter() - started
            if event.finish_reason:
                await model.engine.release_kv(event.kv_handle)  # nothing left to decode
                log.info("prefill %s: %d prompt tokens (%d cached) in %.3f s; finished at the first token (%s)",
                         model.name, len(prompt_ids), event.num_cached_tokens, seconds, event.finish_reason)
                return PrefillOutcome(event, "", 0, "")
            layout = replace(model.kv_layout, num_tokens=len(prompt_ids))
            kv_bytes = layout.bytes_per_token_per_layer * layout.num_layers * layout.num_tokens
            handle = f"{model.name}/{event.kv_handle}"
            if lease_id and not self.lease_ids.leased(lease_id, handle):
                model.engine.release_kv_nowait(event.kv_handle)
                log.info("prefill %s: lease id %s was released while it ran; its lease ends now", model.name,
                         lease_id)
                raise LeaseReleasedError(f"lease id {lease_id!r} was released while this Prefill ran; its caller "
                                         "has given up on it")
            self.lease_traces.remember(handle)
            log.info("prefill %s: %d prompt tokens (%d cached) in %.3f s; KV lease %s holds %d bytes", model.name,
                     len(prompt_ids), event.num_cached_tokens, seconds, handle, kv_bytes)
            return PrefillOutcome(event, handle, kv_bytes, layout.to_json())

    async def decode(self, model_name: str, prompt_ids: list[int], generated_ids: list[int], params: SamplingParams,
                     source: KVSource | None, request_id: str | None = None,
                     time_left: float | None = None) -> AsyncIterator[TokenEvent]:
        started = time.perf_counter()   # the first token's wait includes the KV pull and its import
        with self.inflight():
            model, reservation = await self._accept(model_name, "decode", prompt_ids, generated_ids, params,
                                                    takes_slot=True)
            log.info("decode %s: %d prompt + %d generated tokens, up to %d in all; %s", model.name, len(prompt_ids),
                     len(generated_ids), params.max_tokens,
                     f"KV from {source.address} (lease {source.kv_handle})" if source is not None and generated_ids
                     else "no KV source: recomputing the prompt")
            with reservation:  # held through the pull: admissions meanwhile must not count its blocks free
                payload = None
                if source is not None and generated_ids:
                    payload = await self._pull(model, source, prompt_ids, request_id, time_left)
                if source is not None and payload is None:
                    self._release_unread(source, request_id)
                events, first = await self._start_decode(model, reservation, payload, prompt_ids, generated_ids,
                                                          params, request_id)
                # `first` was read already when the stream runs on imported KV (this site prefilled nothing)
                with _Observed(self.metrics, model.name, "decode", prefills=first is None,
                               started=started) as observed:
                    async with aclosing(events):  # leaving early must reach the engine's abort now, not at GC
                        if first is not None:
                            observed.token(first)
                            yield first
                        async for event in events:
                            observed.token(event)
                            yield event

    async def _start_decode(self, model: HostedModel, reservation: Reservation, payload: KVPayload | None,
                            prompt_ids: list[int], generated_ids: list[int], params: SamplingParams,
                            request_id: str | None) -> tuple[AsyncIterator[TokenEvent], TokenEvent | None]:
        """The event stream and, when it runs on the imported KV, its first event (read to learn whether
        the engine took the import: one it refuses gives the reservation back, and falls back to recompute here)."""
        if payload is not None:
            events = model.engine.generate_from_kv(payload, params, generated_ids, request_id, reservation)
            try:
                first = await anext(events)
            except KVTransferError as exc:
                log.warning("request %s: engine refused the imported KV (%s); recomputing", request_id, exc)
                self.metrics.kv_fallbacks.inc()
            else:
                return events, first
        return model.engine.generate(prompt_ids, params, request_id, generated_ids, reservation=reservation), None

    def _release_unread(self, source: KVSource, request_id: str | None) -> None:
        """The source's lease, which this site recomputes instead of reading: a pull that failed before
        the source opened it (the peer's Health or data port unreachable, a refused FetchKV) leaves
        it held there, and the router, seeing this site's tokens, counts it taken. Best effort, in the
        background: the recompute does not wait for a peer that may be down."""
        task = asyncio.ensure_future(self._release_at_source(source, request_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release_at_source(self, source: KVSource, request_id: str | None) -> None:
        try:
            await self._peers.client(source.address).release_kv(source.kv_handle, RELEASE_TIMEOUT_S, request_id)
        except aio.AioRpcError as exc:
            log.info("request %s: ReleaseKV of %s on %s failed (%s); the lease will expire there", request_id,
                     source.kv_handle, source.address, exc.code().name)

    async def _pull(self, model: HostedModel, source: KVSource, prompt_ids: list[int], request_id: str | None,
                    time_left: float | None) -> KVPayload | None:
        """The source's KV, verified, or None (logged) when anything about the transfer fails."""
        timeout = self.config.fetch_timeout_s if time_left is None else min(self.config.fetch_timeout_s, time_left)
        layout = replace(model.kv_layout, num_tokens=len(prompt_ids))
        try:
            payload = await self._fetch(source, layout, prompt_ids, request_id, timeout)
        except KVTransferError as exc:
            log.warning("request %s: KV pull from %s failed (%s); recomputing the prefill", request_id,
                        source.address, exc)
            self.metrics.kv_fallbacks.inc()
            return None
        self.metrics.kv_bytes_received.inc(payload.num_bytes)
        return payload

    async def _fetch(self, source: KVSource, layout: KVLayout, prompt_ids: list[int], request_id: str | None,
                     timeout: float) -> KVPayload:
        """Over the peer's KV data port when it has one, else the FetchKV stream; each pull is a link sample."""
        client = self._peers.client(source.address)
        peer = await self._peer_health(client, source.address, timeout)
        if peer.data_address:
            try:
                started = time.perf_counter()
                payload = await receive_bulk(peer.data_address, self.config.peer_token, source.kv_handle, layout,
                                             prompt_ids, timeout, self._peer_ssl,
                                             lambda s: self.links.observe_rtt(peer.site, s))
                seconds = time.perf_counter() - started
                self.links.observe_transfer(peer.site, payload.num_bytes, seconds)
                self.metrics.observe_pull(peer.site, "data_port", payload.num_bytes, seconds)
                return payload
            except KVSourceUnreachable as exc:
                log.info("request %s: %s; using FetchKV", request_id, exc)
                self._peer_info.pop(source.address, None)  # it may have restarted on another port
        started = time.perf_counter()
        call = client.fetch_kv(source.kv_handle, timeout=timeout, request_id=request_id)
        payload = await receive_payload(call, layout, prompt_ids)
        seconds = time.perf_counter() - started
        self.links.observe_transfer(peer.site, payload.num_bytes, seconds)
        self.metrics.observe_pull(peer.site, "grpc", payload.num_bytes, seconds)
        return payload

    async def _peer_health(self, client: AgentClient, address: str, timeout: float) -> Peer:
        """A peer's site name and KV data port (asked once, from its Health)."""
        if address not in self._peer_info:
            try:
                health = await client.health(timeout=timeout)
            except aio.AioRpcError as exc:
                raise KVTransferError(f"KV source {address} is unreachable: {exc.code().name}") from exc
            port = health.kv_data_port
            data_address = f"{address.rpartition(':')[0]}:{port}" if port else None
            self._peer_info[address] = Peer(health.site, data_address)
        return self._peer_info[address]

    async def probe_peer(self, site: str, address: str) -> None:
        """One active link measurement (node_agent.links); failures are only logged."""
        timeout = PROBE_TIMEOUT_S
        client = self._peers.client(address)
        try:
            peer = await self._peer_health(client, address, timeout)
            if peer.data_address:
                result = await probe(peer.data_address, self.config.peer_token, self.config.link_probe_bytes, timeout,
                                     self._peer_ssl)
                self.links.observe_rtt(site, result.rtt_s)
                self.links.observe_transfer(site, result.num_bytes, result.seconds)
            else:
                started = time.perf_counter()
                await client.health(timeout=timeout)
                self.links.observe_rtt(site, time.perf_counter() - started)
        except (KVTransferError, aio.AioRpcError) as exc:
            log.info("link probe of %s (%s) failed: %s", site, address, exc)
            self._peer_info.pop(address, None)

    # -- leases ------------------------------------------------------------------------------

    def _lease(self, kv_handle: str) -> tuple[HostedModel, str]:
        model_name, _, engine_handle = kv_handle.rpartition("/")
        model = self.models.get(model_name)
        if model is None or not engine_handle:
            raise UnknownHandleError(f"KV handle {kv_handle!r} is unknown, released or expired")
        return model, engine_handle

    async def open_export(self, kv_handle: str) -> KVExport:
        """An open export of a lease, for FetchKV or the KV data port; end it with end_export. The
        caller's task is bound to the lease's request when it is not bound already (the data port)."""
        if current() is None:
            self.lease_traces.bind(kv_handle)
        model, engine_handle = self._lease(kv_handle)
        export = await model.engine.open_export(engine_handle)
        log.info("KV lease %s: export of %d chunks opened", kv_handle, export.num_chunks)
        return export

    def end_export(self, kv_handle: str, export: KVExport) -> None:
        """Close the export and end the lease (single use, as with FetchKV)."""
        model, engine_handle = self._lease(kv_handle)
        model.engine.close_export(export)
        model.engine.release_kv_nowait(engine_handle)
        self.lease_traces.forget(kv_handle)
        log.info("KV lease %s: export closed, lease ended", kv_handle)

    async def release_kv(self, kv_handle: str, lease_id: str = "") -> bool:
        """Ends the lease named by its handle or by its Prefill's lease id (a Prefill that has not leased
        yet ends its lease as soon as it makes it). False when no lease was ended now (it was fetched,
        released or expired, or is not made yet)."""
        if not kv_handle and not lease_id:
            raise InvalidRequestError("ReleaseKV names no lease: set kv_handle, lease_id or both")
        _check_lease_id(lease_id)
        handles = {kv_handle} if kv_handle else set()
        leased = self.lease_ids.release(lease_id) if lease_id else None
        if leased is not None:
            handles.add(leased)
        released = False
        for handle in handles:
            released |= await self._release_handle(handle)
        return released

    async def _release_handle(self, kv_handle: str) -> bool:
        self.lease_traces.forget(kv_handle)
        try:
            model, engine_handle = self._lease(kv_handle)
            await model.engine.release_kv(engine_handle)
        except UnknownHandleError:
            return False
        return True

    async def num_leases(self) -> int:
        return sum([(await m.engine.stats()).num_pinned_handles for m in self.models.values()])

    async def release_all_leases(self) -> int:
        released = 0
        for model in self.models.values():
            handles = await model.engine.call(lambda engine: list(engine.leases))
            for handle in handles:
                released += await self._release_handle(f"{model.name}/{handle}")
        return released

    # -- drain -------------------------------------------------------------------------------

    async def drain(self, deadline_s: float) -> None:
        """Refuse new work; wait (up to deadline_s) for in-flight requests and unfetched leases; release the rest."""
        self.draining = True
        give_up = time.monotonic() + deadline_s
        try:
            await asyncio.wait_for(self._idle.wait(), deadline_s)
            while await self.num_leases() and time.monotonic() < give_up:
                await asyncio.sleep(0.05)
        except TimeoutError:
            log.warning("drain deadline passed with %d requests in flight", self.num_inflight)
        released = await self.release_all_leases()
        if released:
            log.info("drain released %d unfetched KV leases", released)

    async def close(self) -> None:
        for task in list(self._releases):
            task.cancel()
        await asyncio.gather(*self._releases, return_exceptions=True)
        await self._peers.close()


def _check_lease_id(lease_id: str) -> None:
    if len(lease_id) > MAX_LEASE_ID_CHARS:
        raise InvalidRequestError(f"lease_id has {len(lease_id)} characters; send at most {MAX_LEASE_ID_CHARS}")


class _Observed:
    """One stream's latency metrics and its closing log line. A plain object the stream calls per token
    rather than a generator around it (a resumption per token per layer), holding its histograms'
    children (a labels() lookup per token otherwise).

    Times run from `started` (default: now); `prefills`: this site computed the prompt (not imported),
    so it counts toward the prefix-cache hit ratio."""

    __slots__ = ("_metrics", "_model", "_rpc", "_prefills", "_ttft", "_inter_token", "_started", "_last",
                 "num_tokens", "finish")

    def __init__(self, metrics: AgentMetrics, model: str, rpc: str, prefills: bool, started: float | None = None):
        self._metrics = metrics
        self._model = model
        self._rpc = rpc
        self._prefills = prefills
        self._ttft = metrics.ttft.labels(model, rpc)
        self._inter_token = metrics.inter_token.labels(model)
        self._started = self._last = started if started is not None else time.perf_counter()
        self.num_tokens = 0
        self.finish: str | None = None

    def token(self, event: TokenEvent) -> None:
        now = time.perf_counter()
        if self.num_tokens:
            self._inter_token.observe(now - self._last)
        else:
            self._ttft.observe(now - self._started)
            if self._prefills:
                self._metrics.observe_prompt(self._model, event.num_prompt_tokens, event.num_cached_tokens)
        self._last = now
        self.num_tokens += 1
        if event.finish_reason:
            self.finish = event.finish_reason

    def __enter__(self) -> _Observed:
        return self

    def __exit__(self, *exc_info) -> None:
        log.info("%s %s done: %d token(s) in %.3f s, %s", self._rpc, self._model, self.num_tokens,
                 time.perf_counter() - self._started,
                 f"finished ({self.finish})" if self.finish else "ended before its finish (cancelled or failed)")


MAX_EMBED_INPUTS = 2048   # inputs of one Embed call (OpenAI's limit for one embeddings request)


def check_embed_request(inputs: list[list[int]], dimensions: int, vocab_size: int, context_length: int,
                        hidden_size: int, pooling_error: str | None) -> None:
    """InvalidRequestError naming what is wrong with an Embed request, before it reaches the engine. The
    messages start with the field they name (`inputs[2]`, `dimensions`): routers map them to their own."""
    if pooling_error is not None:
        raise InvalidRequestError(f"model: this model cannot serve embeddings ({pooling_error})")
    if not inputs:
        raise InvalidRequestError("inputs: empty; send at least one input")
    if len(inputs) > MAX_EMBED_INPUTS:
        raise InvalidRequestError(f"inputs: {len(inputs)} inputs; at most {MAX_EMBED_INPUTS} per call")
    for index, ids in enumerate(inputs):
        if not ids:
            raise InvalidRequestError(f"inputs[{index}]: empty; each input needs at least one token")
        if len(ids) > context_length:
            raise InvalidRequestError(f"inputs[{index}]: {len(ids)} tokens; this model's context holds "
                                      f"{context_length}")
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"inputs[{index}]: token id {bad} is outside the vocabulary (size {vocab_size})")
    if dimensions > hidden_size:
        raise InvalidRequestError(f"dimensions: {dimensions} exceeds this model's embedding size {hidden_size}")
