"""An agent whose site an operator deletes is told so by the registry (410 `site_deleted`), logs one line
naming the site, when and by whom, finishes the request it runs, refuses new ones and exits with status 3,
which the systemd unit does not restart; an agent started for a deleted site exits the same way. Any
other refusal of its token (401) is retried as before, the agent serving on."""

from __future__ import annotations

import asyncio
import configparser
import os
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path

import grpc
import pytest
from grpc import aio

from node_agent.daemon import SITE_DELETED_EXIT_STATUS
from node_agent.proto import agent_pb2
from registry.client import RegistryClient
from registry.migrate import upgrade_to_head
from tests.agent.conftest import MODEL, PEER_TOKEN, RegistryServer, collect, prompt, sampling

# Each test's own 40 ports of this module's range, so tests may run side by side. The range lies among the
# kernel's ephemeral ports, so an outgoing connection may hold one of them for a while: each test takes
# the first ones free in its block (free_ports), for the registry and then the agent.
PORT_BLOCKS = {"drain": 50400, "cordon": 50440, "other-401": 50480, "process": 50520}
PORTS_PER_BLOCK = 40
MAX_TOKENS = 1500  # long enough that the deletion reaches the agent while this request runs
DRAIN_S = 8.0      # the drain's deadline: an unfetched KV lease holds the drain open until then
UNIT = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "edgefire-agent.service"


def free_ports(name: str) -> tuple[int, int]:
    """Two ports of the test's block that nothing holds now: (the registry's, the agent's)."""
    found = []
    for port in range(PORT_BLOCKS[name], PORT_BLOCKS[name] + PORTS_PER_BLOCK):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == 2:
            return found[0], found[1]
    raise RuntimeError(f"no two free ports in {PORT_BLOCKS[name]}-{PORT_BLOCKS[name] + PORTS_PER_BLOCK - 1}")


@pytest.fixture
def registry(request, tmp_path):
    """start(port) -> the real registry service on that port, SQLite behind it; stopped afterwards."""
    servers: list[RegistryServer] = []

    def start(port: int) -> RegistryServer:
        db_url = f"sqlite:///{tmp_path / 'registry.db'}"
        upgrade_to_head(db_url)
        server = RegistryServer(db_url, port, "admin-secret", "router-secret")
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


async def new_site(url: str, name: str) -> str:
    async with RegistryClient(url, "admin-secret") as admin:
        await admin.create_site(name, region="eu-west", country="DE", lat=50.1, lon=8.7)
        return (await admin.issue_site_token(name))["token"]


async def delete_site(url: str, name: str, how: str, agent=None) -> str:
    """Cordons or drains the site (and waits until `agent` drains, if given), deletes it as operator `ops`;
    returns the line its agent should log."""
    async with RegistryClient(url, "admin-secret", actor="ops") as admin:
        if how == "drain":
            await admin.drain(name, DRAIN_S)
            if agent is not None:   # the usual order: the agent drains, then its site is deleted
                assert await eventually(lambda: agent.core.draining), "the agent did not start draining"
        else:
            await admin.cordon(name)
        await admin.delete_site(name)
        entry = (await admin.audit_log())["items"][0]
    assert entry["action"] == "site.delete"
    at = datetime.fromtimestamp(entry["at"], timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"site {name} was deleted from the registry at {at} by admin:ops: draining and stopping"


async def eventually(predicate, timeout_s: float = 10.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest.mark.parametrize("how", ["drain", "cordon"])
async def test_deleting_the_site_of_a_running_agent_drains_it_and_it_exits_3(registry, start_agent, connect, caplog,
                                                                             how):
    caplog.set_level("INFO")
    registry_port, agent_port = free_ports(how)
    server = registry(registry_port)
    token = await new_site(server.url, "site-a")
    agent = await start_agent("site-a", registry_url=server.url, site_token=token, heartbeat_interval_s=0.2,
                              drain_timeout_s=DRAIN_S, kv_lease_ttl_s=60, grpc_listen=f"127.0.0.1:{agent_port}")
    assert await eventually(lambda: agent.heartbeats.num_heartbeats > 0), "the agent never heartbeated"
    client = connect(agent)
    # the prefill half of a split request, whose decode site never fetches the KV: the drain waits for it
    # until its deadline, so new requests meet a draining agent however fast the long one below ends
    leased = await client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt(20), sampling=sampling()))
    assert leased.kv_handle
    stream = client.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(30),
                                                       sampling=sampling(max_tokens=MAX_TOKENS)))
    first = await stream.read()

    line = await delete_site(server.url, "site-a", how, agent)
    assert await eventually(lambda: agent.core.draining), "the agent did not learn that its site was deleted"
    # nothing calls the registry any more (the link reports stop too), even while a drain under way goes on
    assert await eventually(lambda: agent.site_deleted and agent.link_loop._task.done(), timeout_s=DRAIN_S / 2)
    with pytest.raises(aio.AioRpcError) as refused:
        await collect(client.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=[1, 2], sampling=sampling())))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()

    rest = []
    while (chunk := await stream.read()) is not aio.EOF:
        rest.extend(chunk.tokens)
    assert len(first.tokens) + len(rest) == MAX_TOKENS  # the running request ran to its end
    await asyncio.wait_for(agent.wait_stopped(), 30)
    assert agent.exit_code == SITE_DELETED_EXIT_STATUS == 3
    assert agent.models[MODEL].engine.engine.leases == {}  # the unfetched lease was released at the deadline
    assert caplog.messages.count(line) == 1, [m for m in caplog.messages if "deleted" in m]
    assert not [m for m in caplog.messages if "could not deregister" in m or "registry answered 401" in m]


async def test_any_other_401_is_retried_and_the_agent_serves_on(registry, start_agent, connect):
    registry_port, agent_port = free_ports("other-401")
    server = registry(registry_port)
    await new_site(server.url, "site-a")
    agent = await start_agent("site-a", registry_url=server.url, site_token="efs-not-this-sites-token",
                              heartbeat_interval_s=0.2, grpc_listen=f"127.0.0.1:{agent_port}")
    assert await eventually(lambda: agent.heartbeats.num_failures >= 2)
    tokens = await collect(connect(agent).generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(20),
                                                                            sampling=sampling(max_tokens=4))))
    assert len(tokens) == 4 and not agent.core.draining and agent.exit_code == 0


async def test_an_agent_started_for_a_deleted_site_exits_3_and_systemd_leaves_it_down(registry, tmp_path,
                                                                                     tiny_model_dir):
    registry_port, agent_port = free_ports("process")
    server = registry(registry_port)
    token = await new_site(server.url, "proc-1")
    line = await delete_site(server.url, "proc-1", "cordon")
    config = tmp_path / "site.toml"
    config.write_text(f'site = "proc-1"\npeer_token = "{PEER_TOKEN}"\nkv_cache_bytes = 4194304\n'
                      f'heartbeat_interval_s = 0.2\n[models]\n{MODEL} = "{tiny_model_dir}"\n')
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deploy.cli", "agent", "--config", str(config), "--registry-url", server.url,
        "--grpc-listen", f"127.0.0.1:{agent_port}", "--metrics-listen", "none",
        env={**os.environ, "EDGEFIRE_AGENT_DEVICE": "cpu", "EDGEFIRE_AGENT_SITE_TOKEN": token},
        stderr=asyncio.subprocess.PIPE)
    try:
        _, stderr = await asyncio.wait_for(process.communicate(), 90)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    text = stderr.decode()
    assert process.returncode == 3, text
    assert text.count(line) == 1, text
    assert "Traceback" not in text and "registered site" not in text
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(UNIT)
    assert unit["Service"]["Restart"] == "on-failure"
    assert process.returncode in {int(s) for s in unit["Service"]["RestartPreventExitStatus"].split()}
