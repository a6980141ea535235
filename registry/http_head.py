"""Limits on the HTTP request head (request line and headers), and on the time its body may take, for
every edgefire HTTP service: the registry and the router both run uvicorn with `http=HeadLimitedHttp`.

uvicorn's httptools protocol puts no bound on a head: a 32 MiB header was accepted, and four
half-sent 64 MiB heads grew a router by 254 MiB (httptools buffers a header until it is complete).
Nor does it bound the time a head may take, so a client can hold a connection open forever by
sending nothing or a byte at a time. These limits are enforced in the connection's protocol,
before any application code runs, so before authentication:

- more than `max_head_bytes` of request line and headers, or more than `max_headers` headers:
  431 Request Header Fields Too Large;
- a head not complete `head_timeout_s` after the connection opened or the request's first byte
  arrived: 408 Request Timeout (a connection that sent nothing is just closed);
- a body not complete `body_timeout_s` after its head (a Content-Length larger than what is sent,
  a body trickled a byte at a time): 408 Request Timeout. Without it such a request held its
  connection, its task and up to the body limit of memory for ever, as a stalled head did. The
  application sees the client leave (`http.disconnect`) and answers nothing; the 408 is the only
  answer. A body the server itself stopped reading (a pipelined request waiting its turn, a full
  buffer the application has not read yet) is not the client's delay: its time starts again.
Each refusal closes the connection, after a short linger that drains what the client is still
sending: closing with unread input would reset the connection and could destroy the answer.

Over TLS, closing a connection waits for the client's TLS close (up to 30 s in asyncio and uvloop),
and an idle keep-alive client never sends one: a server stopping would wait that long for each.
So at shutdown an idle TLS connection is aborted instead; there is no answer in flight to lose.
"""

from __future__ import annotations

import asyncio
import http

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100
HEAD_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0
LINGER_S = 1.0


class HeadLimitedHttp(HttpToolsProtocol):
    max_head_bytes = MAX_HEAD_BYTES
    max_headers = MAX_HEADERS
    head_timeout_s = HEAD_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._in_head = True  # between the end of a request (or the connection's start) and the end of the next head
        self._head_bytes = 0  # bytes received while in the head: what httptools may be buffering
        self._head_size = 0  # request line and headers parsed so far
        self._num_headers = 0
        self._refusal: int | None = None
        self._head_deadline: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None
        self._start_head_deadline()

    def shutdown(self) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        super().shutdown()
        if idle and self.transport.get_extra_info("sslcontext") is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        self._cancel_body_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # refused: the rest of what the client sends is dropped
        if self._in_head:
            self._start_head_deadline()
            self._head_bytes += len(data)
        super().data_received(data)
        if self._refusal is None and self._in_head and self._head_bytes > self.max_head_bytes:
            self._refusal = 431  # the head is still incomplete and already too long
        if self._refusal is not None:
            self._send_refusal()

    # Parser callbacks: count what the head holds; once refused, the rest of the message is ignored.

    def on_message_begin(self) -> None:
        self._head_size = self._num_headers = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        self._check_head()
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4  # ": " and CRLF
        self._num_headers += 1
        self._check_head()
        if self._refusal is None:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_deadline()
        if self._refusal is None:
            super().on_headers_complete()
            self._start_body_deadline(self.cycle)  # ended by on_message_complete, at once for a request without a body

    def on_body(self, body: bytes) -> None:
        if self._refusal is None:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refusal is not None:
            return
        self._cancel_body_deadline()
        self._in_head, self._head_bytes = True, 0  # the deadline starts with the next request's first byte
        super().on_message_complete()

    # Refusals.

    def _check_head(self) -> None:
        if self._refusal is None and (self._head_size > self.max_head_bytes or self._num_headers > self.max_headers):
            self._refusal = 431

    def _start_head_deadline(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing() or not self._in_head or self._refusal is not None:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._start_head_deadline()  # a response is still being sent (a stream): its client is not idle
            return
        if self._head_bytes == 0:
            self.transport.close()  # nothing of a request arrived: an idle connection, nothing to answer
            return
        self._refusal = 408
        self._send_refusal()

    def _start_body_deadline(self, cycle) -> None:
        self._cancel_body_deadline()
        self._body_deadline = self.loop.call_later(self.body_timeout_s, self._body_timed_out, cycle)

    def _cancel_body_deadline(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _body_timed_out(self, cycle) -> None:
        self._body_deadline = None
        if self.transport.is_closing() or self._refusal is not None or cycle.response_started:
            if cycle.response_complete and not self.transport.is_closing():
                self.transport.close()  # answered without its body (a 413), which still trickles in
            return
        if self.flow.read_paused or any(queued is cycle for queued, _app in self.pipeline):
            self._start_body_deadline(cycle)  # the server is not reading it: not the client's delay
            return
        # The application may be waiting in receive(): it sees the client leave, and its sends are dropped.
        cycle.disconnected = True
        cycle.message_event.set()
        self._refusal = 408
        self._send_refusal(f"request body not complete within {self.body_timeout_s:g} s")

    def _send_refusal(self, message: str | None = None) -> None:
        if self.transport.is_closing():
            return
        self._cancel_head_deadline()
        self._cancel_body_deadline()
        status = http.HTTPStatus(self._refusal)
        message = message or {431: f"request head exceeds {self.max_head_bytes} bytes or {self.max_headers} headers",
                              408: f"request head not complete within {self.head_timeout_s:g} s"}[self._refusal]
        body = f'{{"error": {{"message": "{message}", "type": "invalid_request_error", "code": "{status.name.lower()}"}}}}'
        self.transport.write(
            f"HTTP/1.1 {status.value} {status.phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n{body}".encode())
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)  # meanwhile data_received drops what arrives
        else:
            self.transport.close()


class RepeatedHeader(ValueError):
    """A header that must come once was sent more than once."""


def single_header(raw_headers, name: bytes) -> str | None:
    """The value of header `name` (lowercase) in ASGI raw headers, None when absent; RepeatedHeader when
    it is sent more than once (which copy a hop in between added is not knowable). One pass, nothing
    allocated beyond the value's text: the heartbeat and completion endpoints call it per request."""
    found = None
    for key, value in raw_headers:
        if key == name:
            if found is not None:
                raise RepeatedHeader(name.decode("latin-1"))
            found = value
    return None if found is None else found.decode("latin-1")
