"""Measured links: KV pulls and data-port probes measure the path to a peer; agents report it to the
registry, whose snapshot hands it to routers."""

from __future__ import annotations

import httpx
import pytest

from engine.errors import KVTransferError
from node_agent.kv_data import probe
from node_agent.links import LinkLoop, LinkSettings, LinkTable
from node_agent.metrics import AgentMetrics
from node_agent.proto import agent_pb2
from registry.client import RegistryClient
from router.snapshot import parse_snapshot
from tests.agent.conftest import MODEL, PEER_TOKEN, collect, prompt, sampling
from tests.agent.test_registry import wait_until

PARAMS = sampling(max_tokens=4)


async def pull(client_a, client_b, a, prompt_ids) -> int:
    """Prefill at a, decode at b from a's KV; returns the KV bytes that moved."""
    result = await client_a.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids, sampling=PARAMS))
    await collect(client_b.decode(agent_pb2.DecodeRequest(
        model=MODEL, prompt_ids=prompt_ids, generated_ids=[result.first_token.token_id], sampling=PARAMS,
        kv_source=agent_pb2.KVSource(address=a.address, kv_handle=result.kv_handle)), timeout=30))
    return result.kv_bytes


@pytest.mark.parametrize("transport", ["data-port", "grpc"])
async def test_a_kv_pull_measures_the_path_to_its_source(start_agent, connect, transport):
    a, b = await start_agent("site-a"), await start_agent("site-b")
    if transport == "grpc":
        a.core.kv_data_server = None  # Health reports no data port: b pulls over FetchKV
    kv_bytes = await pull(connect(a), connect(b), a, prompt(200, start=3))
    assert kv_bytes >= 16 << 10  # enough to count as a throughput sample
    link = b.core.links.peers["site-a"]
    assert link.bandwidth_mbps > 0
    if transport == "data-port":
        assert link.rtt_ms > 0  # the data port's connect time
    assert "site-b" not in a.core.links.peers  # the source measured nothing


async def test_a_probe_is_authenticated_and_bounded(start_agent, connect):
    a = await start_agent("site-a")
    data_address = f"127.0.0.1:{(await connect(a).health()).kv_data_port}"
    result = await probe(data_address, PEER_TOKEN, 64 << 10, timeout=5)
    assert result.num_bytes == 64 << 10 and result.rtt_s > 0 and result.seconds > 0
    with pytest.raises(KVTransferError, match="wrong peer token"):
        await probe(data_address, "not-the-token", 64 << 10, timeout=5)
    with pytest.raises(KVTransferError, match="a probe asks for 1 to"):
        await probe(data_address, PEER_TOKEN, 64 << 20, timeout=5)


async def test_probe_peer_measures_both_figures(start_agent):
    a = await start_agent("site-a")
    b = await start_agent("site-b", link_probe_bytes=128 << 10, metrics_listen="127.0.0.1:0")
    await b.core.probe_peer("site-a", a.address)
    link = b.core.links.peers["site-a"]
    assert link.rtt_ms > 0 and link.bandwidth_mbps > 0
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"http://127.0.0.1:{b.metrics_port}/metrics")).text
    assert 'edgefire_agent_link_bandwidth_mbps{peer="site-a"}' in metrics
    assert 'edgefire_agent_link_rtt_milliseconds{peer="site-a"}' in metrics
    assert b.core.links.take_reports() == [{"peer": "site-a", "rtt_ms": link.rtt_ms,
                                            "bandwidth_mbps": link.bandwidth_mbps}]
    assert b.core.links.take_reports() == []  # reported once until sampled again


def test_a_quiet_path_is_probed_at_most_once_per_interval():
    now = [0.0]
    table = LinkTable(clock=lambda: now[0])
    assert table.needs_probe("site-a", 60.0)  # never measured
    table.mark_probed("site-a")
    now[0] = 59.0
    assert not table.needs_probe("site-a", 60.0)
    now[0] = 100.0
    table.observe_transfer("site-a", 1 << 20, 0.01)  # a real pull: no probe needed for another interval
    now[0] = 150.0
    assert not table.needs_probe("site-a", 60.0)
    now[0] = 161.0
    assert table.needs_probe("site-a", 60.0)


async def test_two_agents_with_a_pull_between_them_put_a_measured_link_in_the_registry(
        registry_server, start_agent, connect):
    tokens = {}
    async with RegistryClient(registry_server.url, "admin-secret") as admin:
        for name in ("site-a", "site-b"):
            await admin.create_site(name, region="eu-west", country="DE", lat=50.1, lon=8.7)
            tokens[name] = (await admin.issue_site_token(name))["token"]
    # Probing is off, so what arrives can only come from the pull.
    agents = {name: await start_agent(name, registry_url=registry_server.url, site_token=tokens[name],
                                      link_probe_interval_s=0.0, link_report_interval_s=0.2)
              for name in ("site-a", "site-b")}
    a, b = agents["site-a"], agents["site-b"]
    await pull(connect(a), connect(b), a, prompt(200, start=11))

    async def measured():
        async with RegistryClient(registry_server.url, "router-secret") as router:
            doc, _ = await router.snapshot()
        return parse_snapshot(doc).link("site-a", "site-b", max_age_s=60.0)

    link = await wait_until(measured)
    assert link is not None, "the pull's measurement never reached the registry"
    assert (link.src, link.dst) == ("site-b", "site-a")  # the puller measured the path to its source
    assert link.rtt_ms > 0 and link.bandwidth_mbps > 0
    assert link.bandwidth_mbps == pytest.approx(b.core.links.peers["site-a"].bandwidth_mbps)


async def test_an_idle_pair_is_measured_by_a_probe(registry_server, start_agent):
    tokens = {}
    async with RegistryClient(registry_server.url, "admin-secret") as admin:
        for name in ("site-a", "site-b", "other-model"):
            await admin.create_site(name, region="eu-west", country="DE", lat=50.1, lon=8.7)
            tokens[name] = (await admin.issue_site_token(name))["token"]
    for name in ("site-a", "site-b"):  # a 1 s heartbeat keeps both alive (TTL 3 s) on a loaded machine
        await start_agent(name, registry_url=registry_server.url, site_token=tokens[name], heartbeat_interval_s=1.0,
                          link_report_interval_s=0.2)

    async def measured():
        async with RegistryClient(registry_server.url, "router-secret") as router:
            doc, _ = await router.snapshot()
        return doc["links"] if len(doc["links"]) == 2 else None

    links = await wait_until(measured)
    assert links, "no probe measured the idle pair"
    assert {(link["src"], link["dst"]) for link in links} == {("site-a", "site-b"), ("site-b", "site-a")}
    assert all(link["rtt_ms"] > 0 and link["bandwidth_mbps"] > 0 for link in links)
    async with RegistryClient(registry_server.url, tokens["site-a"]) as agent_a:
        peers = (await agent_a.peers())["peers"]
    assert [peer["name"] for peer in peers] == ["site-b"]  # never itself, nor a site that never reported


async def test_a_peer_the_registry_no_longer_lists_leaves_the_table_and_the_metrics():
    """A deregistered peer's link gauges showed its last figures for as long as the agent ran."""
    table = LinkTable()
    for peer in ("site-b", "site-c"):
        table.observe_rtt(peer, 0.002)
        table.observe_transfer(peer, 4 << 20, 0.01)

    class Registry:
        listed = [{"name": "site-b", "grpc_address": "127.0.0.1:1"}, {"name": "site-c", "grpc_address": "127.0.0.1:2"}]

        async def peers(self):
            return {"peers": self.listed}

        async def post_links(self, reports):
            pass

    async def no_probe(name, address):
        pass

    registry = Registry()
    loop = LinkLoop(registry, table, no_probe, LinkSettings(probe_interval_s=60.0))
    metrics = AgentMetrics()
    await loop.tick()
    metrics.observe_links(table.peers)
    assert 'peer="site-c"' in metrics.render().decode()
    registry.listed = registry.listed[:1]  # site-c deregistered
    await loop.tick()
    metrics.observe_links(table.peers)
    assert set(table.peers) == {"site-b"}
    text = metrics.render().decode()
    assert 'peer="site-c"' not in text and 'peer="site-b"' in text
