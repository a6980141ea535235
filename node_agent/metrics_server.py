"""The metrics port: a minimal HTTP/1.0 server that answers GET /metrics with a Prometheus registry's text.

Agents and routers serve their metrics on a port of their own (`metrics_listen`), apart from their
API: an operator binds it to an internal interface for Prometheus, and the public port stays what
it is (the OpenAI API on a router, gRPC on an agent). It needs no token, so it must not face the
internet; `metrics_tls` serves it over HTTPS. Torch-free, so the router can use it.

    server = MetricsServer(registry, refresh)      # refresh: awaited before each scrape, or None
    await server.start("127.0.0.1:0")              # server.port is the bound port
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 5.0     # the whole request head must arrive within this
MAX_HEAD_LINES = 100     # a scraper sends a handful of headers
PATH = b"/metrics"


class MetricsServer:
    def __init__(self, registry: CollectorRegistry, refresh: Callable[[], Awaitable[None]] | None = None) -> None:
        self._registry = registry
        self._refresh = refresh
        self._server: asyncio.Server | None = None
        self.port: int | None = None

    async def start(self, listen: str, ssl_context: ssl.SSLContext | None = None) -> None:
        """Serves on host:port (port 0: any free port); HTTPS with `ssl_context`."""
        host, _, port = listen.rpartition(":")
        self._server = await asyncio.start_server(self._handle, host.strip("[]") or "127.0.0.1", int(port),
                                                  ssl=ssl_context)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(self._read_head(reader), READ_TIMEOUT_S)
            if request_line is None:
                body, status, ctype = b"request head too large\n", b"431 Request Header Fields Too Large", b"text/plain"
            else:
                method, _, rest = request_line.partition(b" ")
                path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
                if method != b"GET":
                    body, status, ctype = b"only GET is served\n", b"405 Method Not Allowed", b"text/plain"
                elif path != PATH:
                    body, status, ctype = b"not found: the metrics are at GET /metrics\n", b"404 Not Found", b"text/plain"
                else:
                    if self._refresh is not None:
                        await self._refresh()
                    body, status, ctype = generate_latest(self._registry), b"200 OK", CONTENT_TYPE_LATEST.encode()
            writer.write(b"HTTP/1.0 " + status + b"\r\nContent-Type: " + ctype +
                         b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, ssl.SSLError) as exc:
            log.debug("metrics request dropped: %r", exc)
        finally:
            writer.close()

    @staticmethod
    async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
        """The request line, once the head has ended; None for a head past the line limits."""
        try:
            request_line = await reader.readline()
            for _ in range(MAX_HEAD_LINES):
                if not (await reader.readline()).strip():
                    return request_line.strip()
        except ValueError:  # a line past the stream's limit (64 KiB)
            return None
        return None

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
