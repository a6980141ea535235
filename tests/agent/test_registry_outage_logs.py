"""A registry that accepts connections but never answers (stopped with SIGSTOP, or hung) is named in
the agent's log: the kind of failure and the URL, not an empty "registry call failed ()"."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from node_agent.heartbeat import HeartbeatLoop, Registration
from node_agent.links import LinkLoop, LinkSettings, LinkTable
from registry.client import RegistryClient
from registry.wire import CapacityReport


@pytest.fixture
def silent_registry():
    """The URL of a port whose connections the kernel accepts and nobody ever answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.02)


async def test_heartbeat_to_a_silent_registry_logs_a_timeout_and_the_url(silent_registry, caplog):
    client = RegistryClient(silent_registry, "site-token", timeout=0.2)
    registration = Registration("site-a", "127.0.0.1:1", [], 1.0)

    async def never_asked() -> CapacityReport:
        raise AssertionError("the site never registered, so no heartbeat is built")

    loop = HeartbeatLoop(client, registration, never_asked)
    with caplog.at_level(logging.WARNING, logger="node_agent.heartbeat"):
        loop.start()
        await _until(lambda: loop.num_failures >= 1)
        await loop.stop(deregister=False)
    lines = [r.getMessage() for r in caplog.records if "registry call failed" in r.getMessage()]
    assert lines and "ReadTimeout" in lines[0] and f"{silent_registry}/v1/agent/registration" in lines[0], lines


async def test_link_report_to_a_silent_registry_logs_a_timeout(silent_registry, caplog):
    client = RegistryClient(silent_registry, "site-token", timeout=0.2)

    async def probe(_site: str, _address: str) -> None:
        raise AssertionError("no peer list came back, so nothing is probed")

    loop = LinkLoop(client, LinkTable(), probe, LinkSettings(report_interval_s=60.0))
    with caplog.at_level(logging.INFO, logger="node_agent.links"):
        loop.start()
        await _until(lambda: any("link report" in r.getMessage() for r in caplog.records))
        await loop.stop()
    await client.aclose()
    line = next(r.getMessage() for r in caplog.records if "link report" in r.getMessage())
    assert "ReadTimeout" in line and silent_registry in line, line
