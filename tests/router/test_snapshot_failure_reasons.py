"""Why the router's snapshot poll fails, as /healthz and /metrics say it: a registry that refuses the router's
token (401) is `unauthorized`, one that answers an error (500) is `error_status`, and only a registry that
does not answer at all (a closed port) is `unreachable`; each failed poll counts in
edgefire_router_snapshot_failures_total{reason} (router/snapshot_feed.py)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from registry.client import RegistryClient
from router.metrics import RouterMetrics
from router.snapshot_feed import FAILURE_REASONS, SnapshotFeed

from tests.router.conftest import ROUTER_TOKEN

CLOSED_PORT = 48301  # nothing listens here: a refused connection


def snapshot_failures(metrics: RouterMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {sample.labels["reason"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "edgefire_router_snapshot_failures_total"}


@pytest.fixture
async def failing_registry():
    """The URL of a server that answers every request with a registry-shaped 500."""
    body = json.dumps({"error": {"message": "database is locked", "code": "internal"}}).encode()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()
    await server.wait_closed()


async def test_each_failure_is_named_and_counted_by_its_reason(cluster, failing_registry, caplog):
    registries = {"ok": cluster.client(ROUTER_TOKEN), "wrong_token": cluster.client("not-the-router-token"),
                  "error": RegistryClient(failing_registry, ROUTER_TOKEN, timeout=5),
                  "closed": RegistryClient(f"http://127.0.0.1:{CLOSED_PORT}", ROUTER_TOKEN, timeout=5)}
    polled = ["ok"]
    feed = SnapshotFeed(lambda etag: registries[polled[0]].snapshot(etag), refresh_s=60.0)
    metrics = RouterMetrics()
    metrics.follow(feed)
    try:
        assert snapshot_failures(metrics) == dict.fromkeys(FAILURE_REASONS, 0)  # every series, before any failure
        assert await feed.refresh()
        caplog.set_level(logging.WARNING, logger="router.snapshot_feed")
        expected = {}
        for name, reason, said, level in [
                ("wrong_token", "unauthorized", "registry answered 401", logging.ERROR),
                ("wrong_token", "unauthorized", "registry answered 401", None),
                ("error", "error_status", "registry answered 500: database is locked", logging.WARNING),
                ("closed", "unreachable", "registry unreachable", logging.WARNING)]:
            polled[0] = name
            caplog.clear()
            assert not await feed.refresh()
            body = feed.status().body()
            # Still healthy and placing with the last good view: what an operator sees is the reason.
            assert (body["registry"], body["ok"], body["view"]) == (reason, True, "last_good"), body
            assert said in body["last_error"]
            assert [r.levelno for r in caplog.records] == ([level] if level else []), name  # once a streak
            expected[reason] = expected.get(reason, 0) + 1
            assert snapshot_failures(metrics) == {**dict.fromkeys(FAILURE_REASONS, 0), **expected}
        polled[0] = "ok"
        assert await feed.refresh() and feed.status().body()["registry"] == "ok"
        assert snapshot_failures(metrics)["unauthorized"] == 2  # a counter: it stays after recovery
    finally:
        for name in ("error", "closed"):
            await registries[name].aclose()


async def test_a_wrong_router_token_says_which_setting_to_fix(cluster):
    client = cluster.client("not-the-router-token")
    feed = SnapshotFeed(client.snapshot, refresh_s=60.0)
    assert not await feed.refresh()
    status = feed.status()
    assert status.registry == "unauthorized" and "registry_token" in status.last_error
    assert "not-the-router-token" not in status.last_error
