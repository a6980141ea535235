"""The heartbeat says how many of its prefix-cache hashes are held (`num_held`: the leading ones, blocks that
running sequences or KV leases hold; the rest are evictable), from the engine's block manager, cut with the
hashes; a registry older than the field gets summaries without it."""

from __future__ import annotations

import asyncio

from pydantic import create_model

from engine.prefix_hash import prefix_hashes
from node_agent.daemon import Agent
from node_agent.heartbeat import HeartbeatLoop, ModelFigures, Registration, capacity_report, site_capacity_report
from node_agent.proto import agent_pb2
from registry.wire import MAX_CACHE_HASHES, CapacityReport, SnapshotCapacity, WireModel
from tests.agent.conftest import MODEL, PEER_TOKEN, agent_config, collect, prompt, sampling
from tests.agent.test_heartbeat_hardening import OlderRegistry
from tests.agent.test_heartbeat_model_capacity import hashes, stats


async def held_and_cached(agent, expected_held: int) -> SnapshotCapacity:
    """The router's view of the agent's heartbeat once `expected_held` hashes are held (a stream's end and a
    lease's release land on the engine a moment after the call returns)."""
    for _ in range(100):
        report = SnapshotCapacity.model_validate((await agent.capacity()).to_json())
        if report.prefix_cache_summary.num_held == expected_held:
            return report
        await asyncio.sleep(0.02)
    raise AssertionError(f"num_held is {report.prefix_cache_summary.num_held}, not {expected_held}")


async def test_the_heartbeat_holds_a_leased_prefix_and_not_a_finished_ones(tiny_model_dir, connect):
    agent = Agent(agent_config(tiny_model_dir, "held-cache"))
    await agent.start()
    try:
        client = connect(agent.address, PEER_TOKEN)
        finished, leased = prompt(40, start=7), prompt(40, start=300)
        await collect(client.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=finished,
                                                                sampling=sampling(2))))
        lease = await client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=leased, sampling=sampling()))
        held = set(prefix_hashes(leased, 16))
        report = await held_and_cached(agent, len(held))
        assert report.held_hashes == held  # the lease holds its two whole blocks: they lead the summary
        assert set(prefix_hashes(finished, 16)) <= report.cached_hashes - report.held_hashes  # evictable
        assert await client.release_kv(lease.kv_handle)
        report = await held_and_cached(agent, 0)
        assert report.held_hashes == frozenset() and held <= report.cached_hashes
    finally:
        await agent.stop()


def test_the_hash_cap_cuts_num_held_with_the_hashes():
    cached = hashes(1, MAX_CACHE_HASHES + 10)
    summary = capacity_report(16, False, [stats(100, 0)], cached, num_held=MAX_CACHE_HASHES + 5).prefix_cache_summary
    assert (summary.num_hashes, summary.num_held) == (MAX_CACHE_HASHES, MAX_CACHE_HASHES)
    assert capacity_report(16, False, [stats(100, 0)], cached[:7], num_held=3).prefix_cache_summary.num_held == 3
    figures = {f"m{i}": ModelFigures(stats(100, 50), hashes(i, MAX_CACHE_HASHES), num_held=MAX_CACHE_HASHES - 1)
               for i in range(2)}
    figures["small"] = ModelFigures(stats(100, 50), hashes(9, 10), num_held=4)
    wire = site_capacity_report(16, False, figures).to_json()
    sent = {name: own["prefix_cache_summary"] for name, own in wire["models"].items()}
    share = (MAX_CACHE_HASHES - 10) // 2
    assert {name: (len(s["hashes"]), s["num_held"]) for name, s in sent.items()} == {
        "m0": (share, share), "m1": (share, share), "small": (10, 4)}
    CapacityReport.model_validate(wire)


def test_without_per_model_figures_the_held_hashes_of_every_model_lead_the_site_summary():
    report = site_capacity_report(16, False, {"a": ModelFigures(stats(100, 0), hashes(1, 3), num_held=1),
                                              "b": ModelFigures(stats(100, 100), hashes(2, 2), num_held=2)})
    folded = report.to_json({"models"})["prefix_cache_summary"]
    assert folded["hashes"] == [hashes(1, 1)[0], *hashes(2, 2), *hashes(1, 3)[1:]] and folded["num_held"] == 3
    unknown = site_capacity_report(16, False, {"a": ModelFigures(stats(100, 0), hashes(1, 3)),
                                               "b": ModelFigures(stats(100, 100), hashes(2, 2), num_held=2)})
    assert "num_held" not in unknown.to_json({"models"})["prefix_cache_summary"]  # one did not say: all held


class SummaryOlderRegistry(OlderRegistry):
    """A registry whose prefix-cache summaries predate `num_held`."""

    def __init__(self, known: set[str]):
        super().__init__(known)
        summary = create_model("OlderSummary", __base__=WireModel, block_size=(int, ...), hashes=(list[str], []))
        own = create_model("OlderModelCapacity", __base__=WireModel, kv_blocks_total=(int, ...),
                           kv_blocks_free=(int, ...), prefix_cache_summary=(summary | None, None))
        fields = {name: (info.annotation, info) for name, info in CapacityReport.model_fields.items() if name in known}
        fields["prefix_cache_summary"] = (summary | None, None)
        if "models" in known:
            fields["models"] = (dict[str, own] | None, None)
        self.contract = create_model("OlderCapacityReport", __base__=WireModel, **fields)


async def beat_once(registry: OlderRegistry) -> HeartbeatLoop:
    async def capacity() -> CapacityReport:
        return site_capacity_report(16, False, {"a": ModelFigures(stats(100, 0), hashes(1, 3), num_held=1),
                                                "b": ModelFigures(stats(100, 100), hashes(2, 2), num_held=0)})

    loop = HeartbeatLoop(registry, Registration("old-registry", "127.0.0.1:1", [], 30.0), capacity)
    loop.start()
    try:
        await asyncio.wait_for(registry.beat.wait(), 10)
    finally:
        await loop.stop(deregister=True)
    return loop


async def test_a_registry_older_than_num_held_gets_every_summary_without_it(caplog):
    registry = SummaryOlderRegistry(set(CapacityReport.model_fields))
    loop = await beat_once(registry)
    stored = registry.stored[0]
    assert loop.num_failures == 0 and loop.left_out == {"prefix_cache_summary.num_held"}
    assert {name: own["prefix_cache_summary"]["hashes"] for name, own in stored["models"].items()} == {
        "a": hashes(1, 3), "b": hashes(2, 2)}
    assert "does not know the heartbeat field prefix_cache_summary.num_held" in caplog.text
    # older than per-model figures too: the folded site summary goes without it
    registry = SummaryOlderRegistry(set(CapacityReport.model_fields) - {"models"})
    loop = await beat_once(registry)
    assert loop.left_out == {"models", "prefix_cache_summary.num_held"}
    assert sorted(registry.stored[0]["prefix_cache_summary"]["hashes"]) == sorted(hashes(1, 3) + hashes(2, 2))
