"""The KV data port: FetchKV's bytes over a plain TCP socket, for speed.

gRPC in Python tops out near 350 MB/s on a 2-core machine, a fraction of what a socket moves, so
the bulk of a KV transfer skips it. A puller learns a peer's data port from its Health answer
(cached), connects, and sends one request frame; the agent answers with a header and one frame
per chunk:

    request   <B kind, <H token length, token (the peer token, as on gRPC), <H body length, body
    header    <I length, JSON {"kv_layout", "token_ids", "num_chunks"} or {"error"}
    chunk     engine.kv_transfer.CHUNK_HEADER (layer, first_token, num_tokens, xxh3-64 checksum, data
              length), then the data

A request of kind FETCH carries a KV handle as its body. Kind PROBE carries a byte count (decimal
text, at most MAX_PROBE_BYTES): the agent answers the header {"probe_bytes": n} and then n bytes,
which is how a peer measures the path (node_agent.links) without any KV to move. Both kinds need
a peer token, checked against the same node_agent.auth.RoleTokens as FetchKV (so during a rotation
the previous or next peer token opens this port exactly when it opens FetchKV); the agent token
routers hold opens nothing here.

Any failure on either side is one closed connection or an error header; the puller's checks
(layout, sizes, coverage, every checksum) turn it into a KVTransferError and Decode recomputes.
A lease is single use here too: the stream that reads it ends it. A puller whose peer has no data
port (or whose connection or TLS handshake fails) uses gRPC's FetchKV.

TLS: a site with a certificate serves this port only over TLS (the handshake comes before the
request frame, so the peer token never crosses in clear), and pullers that call their peers over
TLS speak TLS here too (probes included, so a probe measures the path KV will take). The request
and header move on the event loop through non-blocking sockets (`ssl` signals "want read/write",
answered by waiting on the loop); the bulk of the bytes moves on a thread of its own with blocking
`sendall`/`recv_into`, which release the GIL while OpenSSL encrypts. The cost against plaintext is
measured in benchmarks/kv_transfer.py.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy

from engine.async_engine import kv_chunks
from engine.errors import EngineError, KVTransferError
from engine.kv_export import KVExport
from engine.kv_transfer import CHUNK_HEADER, KVChunk, KVLayout, KVPayload
from node_agent.auth import KV_DATA, PEER, UNAUTHENTICATED, AuthObserver, RoleTokens
from node_agent.config import MAX_PROBE_BYTES
from node_agent.proto import agent_pb2
from node_agent.transfer import PayloadAssembler, chunk_message

log = logging.getLogger(__name__)

LENGTH = struct.Struct("<H")
HEADER = struct.Struct("<I")
KIND = struct.Struct("<B")
FETCH, PROBE = 1, 2
REQUEST_TIMEOUT_S = 10.0
MAX_HEADER_BYTES = 64 << 20
_PROBE_FILL = bytes(64 << 10)

ChunkHook = Callable[[int, agent_pb2.KVChunk], Awaitable[agent_pb2.KVChunk | None]]


class KVSourceUnreachable(KVTransferError):
    """No connection to the data port at all (nothing was read): FetchKV may still work."""


class KVDataServer:
    """Serves KV exports on a TCP port. open_export/end_export come from AgentCore."""

    def __init__(self, tokens: RoleTokens, open_export: Callable[[str], Awaitable[KVExport]],
                 end_export: Callable[[str, KVExport], None], on_bytes_sent: Callable[[int], None],
                 ssl_context: ssl.SSLContext | None = None, observer: AuthObserver | None = None):
        self._tokens = tokens
        self._observer = observer  # counts the tokens checked here, as the gRPC interceptor does
        self._ssl = ssl_context
        self._open_export = open_export
        self._end_export = end_export
        self._on_bytes_sent = on_bytes_sent
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()
        self.port = 0
        self.chunk_hook: ChunkHook | None = None  # test seam, as AgentServicer.fetch_kv_hook

    async def start(self, host: str, port: int = 0) -> int:
        self._listener = socket.create_server((host, port))
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._spawn(self._accept_loop())
        return self.port

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            conn.setblocking(False)
            self._spawn(self._serve(conn))

    async def _serve(self, conn: socket.socket) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                if self._ssl is not None:
                    conn = self._ssl.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                    await _retry(conn, conn.do_handshake)
                kind = bytearray(KIND.size)
                await _recv_into(conn, memoryview(kind))
                refused = await self._check_token(conn)
                if refused is not None:
                    await _send_header(conn, {"error": refused})
                    return
                body = (await _recv_exactly(conn, await _recv_length(conn))).decode("utf-8", "replace")
            if KIND.unpack(kind)[0] == PROBE:
                await self._answer_probe(conn, body)
                return
            if KIND.unpack(kind)[0] != FETCH:
                await _send_header(conn, {"error": f"unknown request kind {KIND.unpack(kind)[0]}"})
                return
            kv_handle = body
            try:
                export = await self._open_export(kv_handle)
            except EngineError as exc:
                await _send_header(conn, {"error": str(exc)})
                return
            ended = False

            def end() -> None:
                # Once the last chunk is gathered the blocks are no longer read: the lease ends
                # before that chunk goes out, so a puller that asks again finds it already gone.
                nonlocal ended
                if not ended:
                    ended = True
                    self._end_export(kv_handle, export)
            try:
                await _send_header(conn, {"kv_layout": export.layout.to_json(), "token_ids": export.token_ids,
                                                "num_chunks": export.num_chunks})
                if self.chunk_hook is not None:
                    await self._send_hooked(conn, export, end)
                else:
                    conn.setblocking(True)
                    conn.settimeout(REQUEST_TIMEOUT_S)
                    await _on_own_thread(self._send_blocking, conn, export, end)
            finally:
                end()
        except (OSError, TimeoutError, KVTransferError) as exc:
            log.info("KV data stream ended early: %s", exc)
        finally:
            _close(conn)

    async def _check_token(self, conn: socket.socket) -> str | None:
        """Why the request's token does not open this port (None: it is an accepted peer token)."""
        refusal = "missing or wrong peer token (the KV data port takes the peer token only)"
        # A token of no accepted length is wrong whatever it holds: refuse it before reading on, so a
        # stranger's bytes (a wrong port, a scanner) get their answer now, not at the timeout.
        length = await _recv_length(conn)
        if length not in self._tokens.peer_token_lengths:
            self._count_refused()
            return refusal
        match = self._tokens.match(await _recv_exactly(conn, length))
        if PEER not in match.roles:
            self._count_refused()
            return refusal
        if self._observer is not None:
            self._observer.observe_accepted(KV_DATA, match.role, match.credential)
        return None

    def _count_refused(self) -> None:
        # Always unauthenticated, never permission_denied: a token of no peer token's length is not read,
        # so an agent token and a stranger cannot be told apart here, and the port takes no other role.
        if self._observer is not None:
            self._observer.observe_refused(KV_DATA, UNAUTHENTICATED)

    async def _answer_probe(self, conn: socket.socket, body: str) -> None:
        if not (body.isascii() and body.isdigit()) or not 0 < int(body) <= MAX_PROBE_BYTES:
            await _send_header(conn, {"error": f"a probe asks for 1 to {MAX_PROBE_BYTES} bytes, not {body!r}"})
            return
        num_bytes = int(body)
        await _send_header(conn, {"probe_bytes": num_bytes})
        while num_bytes:
            piece = min(num_bytes, len(_PROBE_FILL))
            await _sendall(conn, memoryview(_PROBE_FILL)[:piece])
            num_bytes -= piece

    def _send_blocking(self, conn: socket.socket, export: KVExport, before_last: Callable[[], None]) -> None:
        """On a worker thread: gather chunk i+1 on another while chunk i goes out (both release the GIL)."""
        chunks = export.chunks()
        with ThreadPoolExecutor(1, thread_name_prefix="kv-gather") as gather:
            pending = gather.submit(next, chunks, None)
            index = 0
            while (chunk := pending.result()) is not None:
                pending = gather.submit(next, chunks, None)
                if index == export.num_chunks - 1:
                    before_last()  # thread-safe: it only queues engine commands
                conn.sendall(chunk.header())
                conn.sendall(chunk.data)
                self._on_bytes_sent(len(chunk.data))
                index += 1

    async def _send_hooked(self, conn: socket.socket, export: KVExport, before_last: Callable[[], None]) -> None:
        """Tests: each chunk passes the hook, which may corrupt it or end the stream."""
        index = 0
        async for chunk in kv_chunks(export):
            if index == export.num_chunks - 1:
                before_last()
            msg = await self.chunk_hook(index, chunk_message(chunk, export if index == 0 else None))
            if msg is None:
                return
            hooked = KVChunk(msg.layer, msg.first_token, msg.num_tokens, msg.data, msg.checksum)
            await _sendall(conn, hooked.header())
            await _sendall(conn, hooked.data)
            index += 1


# Non-blocking socket I/O on the event loop for plain and TLS sockets alike (asyncio's sock_* helpers
# refuse SSLSocket): try the call, and when the socket (or TLS) must wait, wait on the loop.

async def _recv_length(conn: socket.socket) -> int:
    size = bytearray(LENGTH.size)
    await _recv_into(conn, memoryview(size))
    return LENGTH.unpack(size)[0]


async def _recv_exactly(conn: socket.socket, num_bytes: int) -> bytes:
    value = bytearray(num_bytes)
    await _recv_into(conn, memoryview(value))
    return bytes(value)


async def _recv_into(conn: socket.socket, view: memoryview) -> None:
    while view:
        n = await _retry(conn, conn.recv_into, view)
        if not n:
            raise KVTransferError("the puller closed the KV data connection early")
        view = view[n:]


async def _sendall(conn: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[await _retry(conn, conn.send, view, writing=True):]


async def _retry(conn: socket.socket, operation, *args, writing: bool = False):
    loop = asyncio.get_running_loop()
    while True:
        try:
            return operation(*args)
        except ssl.SSLWantReadError:
            await _ready(loop.add_reader, loop.remove_reader, conn)
        except ssl.SSLWantWriteError:
            await _ready(loop.add_writer, loop.remove_writer, conn)
        except BlockingIOError:
            if writing:
                await _ready(loop.add_writer, loop.remove_writer, conn)
            else:
                await _ready(loop.add_reader, loop.remove_reader, conn)


async def _ready(add, remove, conn: socket.socket) -> None:
    future = asyncio.get_running_loop().create_future()
    fd = conn.fileno()
    add(fd, lambda: future.done() or future.set_result(None))
    try:
        await future
    finally:
        remove(fd)


async def _send_header(conn: socket.socket, header: dict) -> None:
    body = json.dumps(header).encode()
    await _sendall(conn, HEADER.pack(len(body)) + body)


async def _on_own_thread(function, *args, **kwargs):
    """function(*args, **kwargs) on a new thread, in this task's context: a transfer's blocking I/O.

    Not asyncio.to_thread: its pool (cpu_count + 4 threads) serves the whole agent, and as many
    peers reading or sending slowly (a congested link, a stalled process) would hold all of it,
    so every other pull, push and grammar compile here waited behind them. A transfer's own thread
    costs far less than the transfer; a server's are only started for authenticated peers, a
    puller's are bounded by its decode admissions."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    context = contextvars.copy_context()

    def run() -> None:
        result = error = None
        try:
            result = context.run(function, *args, **kwargs)
        except BaseException as exc:  # handed to the awaiting task, which raises it
            error = exc
        try:
            loop.call_soon_threadsafe(_settle, done, result, error)
        except RuntimeError:
            pass  # the loop is closed: nobody waits for this answer any more

    threading.Thread(target=run, name="kv-data", daemon=True).start()
    return await done


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():  # the awaiting task was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _close(conn: socket.socket) -> None:
    """Close conn, first waking any thread blocked on it (a bare close leaves a blocked recv or
    send waiting until its timeout, holding the thread, the buffer and, server side, the lease)."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected (any more): nothing is blocked on it
    conn.close()


@dataclass(slots=True)
class ProbeResult:
    rtt_s: float          # request sent to the answer's header received: one round trip
    num_bytes: int
    seconds: float        # header received to the last byte


async def receive_bulk(address: str, peer_token: str, kv_handle: str, expected_layout: KVLayout,
                       prompt_ids: list[int], timeout: float, ssl_context: ssl.SSLContext | None = None,
                       on_connected: Callable[[float], None] | None = None) -> KVPayload:
    """Pull a KV handle from a peer's data port (host:port, TLS with `ssl_context`) into a verified payload.

    on_connected gets the TCP connect time in seconds: one round trip, a free RTT sample."""
    conn = await _connect(address, timeout, ssl_context, on_connected)
    try:
        # Blocking reads on a worker thread: MSG_WAITALL (plain) fills a whole frame in one system call.
        return await _on_own_thread(_pull, conn, peer_token, kv_handle, PayloadAssembler(expected_layout, prompt_ids))
    except TimeoutError as exc:
        raise KVTransferError(f"KV data stream from {address} stalled for {timeout:.0f}s") from exc
    except OSError as exc:
        raise KVTransferError(f"KV data stream from {address} failed: {exc}") from exc
    finally:
        _close(conn)  # also ends the reading thread's wait if we were cancelled


async def probe(address: str, peer_token: str, num_bytes: int, timeout: float,
                ssl_context: ssl.SSLContext | None = None) -> ProbeResult:
    """Ask a peer's data port for num_bytes of filler and time the answer (see node_agent.links)."""
    conn = await _connect(address, timeout, ssl_context)
    try:
        return await _on_own_thread(_probe, conn, peer_token, num_bytes)
    except OSError as exc:  # TimeoutError included
        raise KVTransferError(f"probe of the KV data port {address} failed: {exc}") from exc
    finally:
        _close(conn)


async def _connect(address: str, timeout: float, ssl_context: ssl.SSLContext | None = None,
                   on_connected: Callable[[float], None] | None = None) -> socket.socket:
    """A connected socket (TLS handshake done when `ssl_context`); on_connected gets the TCP connect time."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    started = time.perf_counter()
    try:
        conn = await _on_own_thread(socket.create_connection, (host, int(port)), timeout)
    except OSError as exc:
        raise KVSourceUnreachable(f"cannot reach the KV data port {address}: {exc}") from exc
    if on_connected is not None:
        on_connected(time.perf_counter() - started)
    if ssl_context is None:
        return conn
    try:
        return await _on_own_thread(ssl_context.wrap_socket, conn, server_hostname=host)  # verifies the peer
    except OSError as exc:  # ssl.SSLError included: FetchKV over gRPC may still work
        conn.close()
        raise KVSourceUnreachable(f"no TLS session with the KV data port {address}: {exc}") from exc


def _send_request(conn: socket.socket, kind: int, peer_token: str, body: str) -> None:
    token, data = peer_token.encode(), body.encode()
    conn.sendall(KIND.pack(kind) + LENGTH.pack(len(token)) + token + LENGTH.pack(len(data)) + data)


def _read_header(conn: socket.socket) -> dict:
    size = bytearray(HEADER.size)
    _read_exactly(conn, memoryview(size))
    (length,) = HEADER.unpack(size)
    if length > MAX_HEADER_BYTES:
        raise KVTransferError(f"KV data header declares {length} bytes")
    body = bytearray(length)
    _read_exactly(conn, memoryview(body))
    try:
        header = json.loads(body)
    except json.JSONDecodeError as exc:
        raise KVTransferError(f"KV data header is not JSON ({exc})") from exc
    if "error" in header:
        raise KVTransferError(f"the KV source refused: {header['error']}")
    return header


def _probe(conn: socket.socket, peer_token: str, num_bytes: int) -> ProbeResult:
    sent = time.perf_counter()
    _send_request(conn, PROBE, peer_token, str(num_bytes))
    header = _read_header(conn)
    answered = time.perf_counter()
    if header.get("probe_bytes") != num_bytes:
        raise KVTransferError(f"the probe asked for {num_bytes} bytes, the peer announced {header.get('probe_bytes')}")
    _read_exactly(conn, memoryview(bytearray(num_bytes)))
    return ProbeResult(answered - sent, num_bytes, time.perf_counter() - answered)


def _pull(conn: socket.socket, peer_token: str, kv_handle: str, assembler: PayloadAssembler) -> KVPayload:
    _send_request(conn, FETCH, peer_token, kv_handle)
    header = _read_header(conn)
    try:
        assembler.start(header["kv_layout"], list(header["token_ids"]), int(header["num_chunks"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise KVTransferError(f"KV data header lacks a valid {exc}") from exc
    layout = assembler.payload.layout
    # One uninitialized buffer for the whole payload (numpy.empty does not zero it); frames land in it.
    buffer = memoryview(numpy.empty(layout.num_layers * layout.num_tokens * layout.bytes_per_token_per_layer,
                                    dtype=numpy.uint8))
    frame = memoryview(bytearray(CHUNK_HEADER.size))
    offset = 0
    for _ in range(header["num_chunks"]):
        _read_exactly(conn, frame)
        layer, first, count, digest, length = CHUNK_HEADER.unpack(frame)
        if length > len(buffer) - offset:
            raise KVTransferError(f"KV frame declares {length} bytes, more than the layout leaves ({len(buffer) - offset})")
        data = buffer[offset:offset + length]
        _read_exactly(conn, data)
        offset += length
        assembler.add_chunk(KVChunk(layer, first, count, data, digest))
    return assembler.finish()


def _read_exactly(conn: socket.socket, view: memoryview) -> None:
    flags = 0 if isinstance(conn, ssl.SSLSocket) else socket.MSG_WAITALL  # TLS reads one record at a time
    while view:
        n = conn.recv_into(view, len(view), flags)
        if not n:
            raise KVTransferError("the KV data stream closed early")
        view = view[n:]
