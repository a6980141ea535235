"""Heartbeats reach the real registry; a registry outage never stops generation; heartbeats resume."""

from __future__ import annotations

import asyncio

from registry.client import RegistryClient
from node_agent.proto import agent_pb2
from tests.agent.conftest import MODEL, collect, prompt, sampling


async def site_in_snapshot(url: str, name: str) -> dict:
    async with RegistryClient(url, "router-secret") as router:
        snapshot, _ = await router.snapshot(packed=False)  # the hashes as hex strings
    return next(site for site in snapshot["sites"] if site["name"] == name)


async def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.1):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = await predicate()
        if value or asyncio.get_running_loop().time() > deadline:
            return value
        await asyncio.sleep(interval_s)


async def test_heartbeats_survive_a_registry_outage(registry_server, start_agent, connect):
    async with RegistryClient(registry_server.url, "admin-secret") as admin:
        await admin.create_site("site-a", region="eu-west", country="DE", lat=50.1, lon=8.7)
        site_token = (await admin.issue_site_token("site-a"))["token"]
    agent = await start_agent("site-a", registry_url=registry_server.url, site_token=site_token, region="eu-west",
                              heartbeat_interval_s=0.2)
    client = connect(agent)
    await collect(client.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(40),
                                                            sampling=sampling(max_tokens=3))))

    async def reported():
        site = await site_in_snapshot(registry_server.url, "site-a")
        return site if site["capacity"] and site["capacity"]["prefix_cache_summary"]["hashes"] else None

    site = await wait_until(reported)
    assert site, "no heartbeat reached the registry"
    health = await client.health()
    assert site["grpc_address"] == agent.address
    assert site["capacity"]["kv_blocks_total"] == health.kv_blocks_total
    assert site["capacity"]["block_size"] == 16 and site["capacity"]["draining"] is False
    assert len(site["capacity"]["prefix_cache_summary"]["hashes"]) == 2  # 40 prompt tokens: 2 full blocks
    assert [m["model"] for m in site["models"]] == [MODEL]
    # The site's own KV figures for the model: what GetModelInfo says, and the format its engine checks
    info = await client.model_info(MODEL)
    layout = agent.models[MODEL].engine.engine.kv_layout(1)
    assert site["models"][0]["kv_bytes_per_token"] == info.kv_bytes_per_token > 0
    assert site["models"][0]["kv_format"] == layout.kv_format and layout.dtype in layout.kv_format

    registry_server.stop()
    failures = agent.heartbeats.num_failures
    tokens = await collect(client.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(20),
                                                                     sampling=sampling(max_tokens=6))))
    assert len(tokens) == 6
    assert await wait_until(lambda: _gt(agent.heartbeats.num_failures, failures))

    registry_server.start()
    beats = agent.heartbeats.num_heartbeats
    assert await wait_until(lambda: _gt(agent.heartbeats.num_heartbeats, beats + 1))
    assert (await site_in_snapshot(registry_server.url, "site-a"))["alive"]

    await agent.drain(deadline_s=1.0)
    site = await site_in_snapshot(registry_server.url, "site-a")
    assert site["capacity"] is None  # deregistered


async def _gt(value: int, than: int) -> bool:
    return value > than
