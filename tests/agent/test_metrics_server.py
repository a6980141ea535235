"""The metrics port serves GET /metrics and tells any other request what it serves."""

import asyncio

import httpx
from prometheus_client import CollectorRegistry, Counter

from node_agent.metrics_server import MetricsServer


async def _raw(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer


async def test_metrics_port_serves_metrics_path_only():
    registry = CollectorRegistry()
    Counter("edgefire_probe_total", "a counter to find", registry=registry).inc(3)
    server = MetricsServer(registry)
    await server.start("127.0.0.1:0")
    try:
        async with httpx.AsyncClient() as http:
            base = f"http://127.0.0.1:{server.port}"
            scraped = await http.get(f"{base}/metrics")
            assert scraped.status_code == 200 and "edgefire_probe_total 3.0" in scraped.text
            assert (await http.get(f"{base}/metrics?name[]=edgefire_probe_total")).status_code == 200
            for path in ("/", "/favicon.ico", "/metricsx", "/v1/models"):
                missed = await http.get(base + path)
                assert missed.status_code == 404 and "GET /metrics" in missed.text, path
            assert "edgefire_probe_total" not in missed.text
            assert (await http.post(f"{base}/metrics")).status_code == 405
        huge = await _raw(server.port, b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
        assert huge.startswith(b"HTTP/1.0 431")
        endless = await _raw(server.port, b"GET /metrics HTTP/1.1\r\n" + b"X-A: b\r\n" * 500 + b"\r\n")
        assert endless.startswith(b"HTTP/1.0 431")
    finally:
        await server.stop()
