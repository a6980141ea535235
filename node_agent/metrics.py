"""Prometheus metrics of one agent, on its own CollectorRegistry (two agents can share a process).

Engine gauges are refreshed from `stats()` when scraped, so they are never stale; latencies and
byte counts are recorded where they happen. `MetricsServer` serves `/metrics` with asyncio (HTTPS
with `metrics_tls`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.engine import EngineStats

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_running = Gauge("edgefire_agent_running_requests", "Sequences decoding", ["model"], registry=r)
        self.num_waiting = Gauge("edgefire_agent_waiting_requests", "Sequences queued", ["model"], registry=r)
        self.kv_blocks_used = Gauge("edgefire_agent_kv_blocks_used", "KV blocks in use", ["model"], registry=r)
        self.kv_blocks_free = Gauge("edgefire_agent_kv_blocks_free", "KV blocks free or evictable", ["model"], registry=r)
        self.kv_leases = Gauge("edgefire_agent_kv_leases", "KV handles pinned awaiting fetch", ["model"], registry=r)
        self.prefix_hit_tokens = Gauge("edgefire_agent_prefix_cache_hit_tokens",
                                       "Prompt tokens served from the prefix cache since start", ["model"], registry=r)
        self.prefill_rate = Gauge("edgefire_agent_prefill_tokens_per_second", "Measured prefill rate", ["model"], registry=r)
        self.decode_rate = Gauge("edgefire_agent_decode_tokens_per_second", "Measured decode rate", ["model"], registry=r)
        self.ttft = Histogram("edgefire_agent_ttft_seconds", "Time to first token", ["model", "rpc"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("edgefire_agent_inter_token_seconds", "Time between streamed tokens", ["model"],
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.kv_bytes_sent = Counter("edgefire_agent_kv_bytes_sent", "KV bytes sent by FetchKV", registry=r)
        self.kv_bytes_received = Counter("edgefire_agent_kv_bytes_received", "KV bytes pulled from peers", registry=r)
        self.kv_fallbacks = Counter("edgefire_agent_kv_transfer_fallbacks", "KV pulls that failed and were recomputed",
                                    registry=r)
        self.rejected = Counter("edgefire_agent_rejected_requests", "Requests refused at admission", ["reason"],
                                registry=r)
        self.link_rtt = Gauge("edgefire_agent_link_rtt_milliseconds", "Measured round trip to a peer site",
                              ["peer"], registry=r)
        self.link_bandwidth = Gauge("edgefire_agent_link_bandwidth_mbps", "Measured throughput from a peer site",
                                    ["peer"], registry=r)
        self.active_role = Gauge("edgefire_agent_active_role", "1 for each role this site takes new work for",
                                 ["role"], registry=r)

    def observe_stats(self, model: str, stats: EngineStats) -> None:
        self.num_running.labels(model).set(stats.num_running)
        self.num_waiting.labels(model).set(stats.num_waiting)
        self.kv_blocks_used.labels(model).set(stats.num_blocks_total - stats.num_blocks_free)
        self.kv_blocks_free.labels(model).set(stats.num_blocks_free)
        self.kv_leases.labels(model).set(stats.num_pinned_handles)
        self.prefix_hit_tokens.labels(model).set(stats.prefix_cache_hit_tokens)
        self.prefill_rate.labels(model).set(stats.prefill_tokens_per_s)
        self.decode_rate.labels(model).set(stats.decode_tokens_per_s)

    def observe_links(self, links: dict) -> None:
        """links: peer site -> node_agent.links.PeerLink."""
        for peer, link in links.items():
            if link.rtt_ms is not None:
                self.link_rtt.labels(peer).set(link.rtt_ms)
            if link.bandwidth_mbps is not None:
                self.link_bandwidth.labels(peer).set(link.bandwidth_mbps)

    def observe_role(self, role: str) -> None:
        for name in ("prefill", "decode"):
            self.active_role.labels(name).set(1 if role in (name, "both") else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """A minimal HTTP/1.0 server for Prometheus scrapes: any GET answers the metrics text."""

    def __init__(self, metrics: AgentMetrics, refresh: Callable[[], Awaitable[None]]):
        self._metrics = metrics
        self._refresh = refresh
        self._server: asyncio.Server | None = None
        self.port: int | None = None

    async def start(self, listen: str, ssl_context: ssl.SSLContext | None = None) -> None:
        """Serves on host:port; HTTPS with `ssl_context`."""
        host, _, port = listen.rpartition(":")
        self._server = await asyncio.start_server(self._handle, host or "127.0.0.1", int(port), ssl=ssl_context)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)).strip():
                pass  # headers are not needed
            if request_line.startswith(b"GET "):
                await self._refresh()
                body, status, ctype = self._metrics.render(), b"200 OK", CONTENT_TYPE_LATEST.encode()
            else:
                body, status, ctype = b"only GET is served\n", b"405 Method Not Allowed", b"text/plain"
            writer.write(b"HTTP/1.0 " + status + b"\r\nContent-Type: " + ctype +
                         b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, ssl.SSLError) as exc:
            log.debug("metrics request dropped: %r", exc)
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
