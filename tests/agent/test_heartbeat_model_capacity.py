"""The heartbeat of an agent hosting several models: each model's own KV pool and prefix cache beside the
site's sums, the cap on cache hashes shared so every model keeps some, a single-model heartbeat exactly
as before, and a registry older than per-model figures still given every model's hashes."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from engine.engine import EngineStats
from engine.prefix_hash import prefix_hashes
from node_agent.daemon import Agent
from node_agent.heartbeat import HeartbeatLoop, ModelFigures, Registration, capacity_report, hash_shares, \
    site_capacity_report
from node_agent.proto import agent_pb2
from registry.wire import MAX_CACHE_HASHES, CapacityReport, ModelCapacity, PrefixCacheSummary, SnapshotCapacity
from tests.agent.conftest import PEER_TOKEN, agent_config, collect, prompt, sampling
from tests.agent.test_heartbeat_hardening import OlderRegistry


def stats(total: int, free: int) -> EngineStats:
    return EngineStats(num_blocks_total=total, num_blocks_free=free, block_size=16, num_running=1, num_waiting=0,
                       num_pinned_handles=0, inflight_prefill_tokens=0, inflight_decode_tokens=0,
                       prefill_tokens_per_s=0.0, decode_tokens_per_s=0.0, decode_batch_size=0.0,
                       decode_kv_tokens=0.0, num_preemptions=0, prefix_cache_hit_tokens=0)


def hashes(model: int, count: int) -> list[str]:
    return [f"{model:04x}{i:012x}" for i in range(count)]


def test_each_model_reports_its_own_pool_beside_the_sums():
    report = site_capacity_report(16, False, {"a": ModelFigures(stats(100, 0), hashes(1, 3)),
                                              "b": ModelFigures(stats(300, 300), hashes(2, 2))})
    wire = report.to_json()
    assert (wire["kv_blocks_total"], wire["kv_blocks_free"]) == (400, 300)  # what the planner and status read
    assert {name: (own["kv_blocks_total"], own["kv_blocks_free"], own["prefix_cache_summary"]["hashes"])
            for name, own in wire["models"].items()} == {"a": (100, 0, hashes(1, 3)), "b": (300, 300, hashes(2, 2))}
    assert wire["prefix_cache_summary"]["hashes"] == []  # not twice in one heartbeat
    assert CapacityReport.model_validate(wire) == report  # what the registry accepts


def test_a_single_model_heartbeat_is_the_one_sent_before():
    engine, cached = stats(100, 40), hashes(1, 5)
    engine.gpu_indices = (0,)
    report = site_capacity_report(16, False, {"a": ModelFigures(engine, cached)})
    assert report.to_json() == capacity_report(16, False, [engine], cached).to_json()
    assert "models" not in report.to_json()


def test_six_models_share_the_cap_and_each_keeps_its_most_recent_hashes():
    figures = {f"m{i}": ModelFigures(stats(100, 50), hashes(i, 4096)) for i in range(6)}
    figures["small"] = ModelFigures(stats(100, 50), hashes(9, 10))
    wire = site_capacity_report(16, False, figures).to_json()
    sent = {name: own["prefix_cache_summary"]["hashes"] for name, own in wire["models"].items()}
    assert sent["small"] == hashes(9, 10)  # the share it does not need goes to the others
    assert all(sent[f"m{i}"] == hashes(i, (MAX_CACHE_HASHES - 10) // 6) for i in range(6))
    assert sum(map(len, sent.values())) <= MAX_CACHE_HASHES
    CapacityReport.model_validate(wire)


def test_hash_shares_fill_the_budget_fairly():
    assert hash_shares([10, 4096, 4096], 100) == [10, 45, 45]
    assert hash_shares([5, 7], 100) == [5, 7]
    shares = hash_shares([4096] * 6, MAX_CACHE_HASHES)
    assert sum(shares) == MAX_CACHE_HASHES and min(shares) == MAX_CACHE_HASHES // 6
    assert hash_shares([], 100) == []


def test_a_heartbeat_over_the_cap_in_all_is_refused_naming_the_cap():
    own = {name: ModelCapacity(kv_blocks_total=1, kv_blocks_free=1, prefix_cache_summary=PrefixCacheSummary(
        block_size=16, hashes=hashes(i, MAX_CACHE_HASHES // 2 + 1))) for i, name in enumerate("ab")}
    with pytest.raises(ValidationError, match=f"over the cap of {MAX_CACHE_HASHES}"):
        CapacityReport(kv_blocks_total=2, kv_blocks_free=2, block_size=16, models=own)
    with pytest.raises(ValidationError, match="kv_blocks_free cannot exceed kv_blocks_total"):
        ModelCapacity(kv_blocks_total=1, kv_blocks_free=2)


async def test_a_registry_older_than_per_model_figures_gets_every_models_hashes_in_the_site_summary(caplog):
    registry = OlderRegistry(set(CapacityReport.model_fields) - {"models"})

    async def capacity() -> CapacityReport:
        return site_capacity_report(16, False, {"a": ModelFigures(stats(100, 0), hashes(1, 3)),
                                                "b": ModelFigures(stats(100, 100), hashes(2, 2))})

    loop = HeartbeatLoop(registry, Registration("old-registry", "127.0.0.1:1", [], 30.0), capacity)
    loop.start()
    try:
        await asyncio.wait_for(registry.beat.wait(), 10)
    finally:
        await loop.stop(deregister=True)
    stored = registry.stored[0]
    assert loop.num_failures == 0 and loop.left_out == {"models"} and "models" not in stored
    assert (stored["kv_blocks_total"], stored["kv_blocks_free"]) == (200, 100)
    assert sorted(stored["prefix_cache_summary"]["hashes"]) == sorted(hashes(1, 3) + hashes(2, 2))
    assert "does not know the heartbeat field models" in caplog.text


async def test_an_agent_reports_the_prefix_each_model_cached_under_that_model(tiny_model_dir, connect):
    agent = Agent(agent_config(tiny_model_dir, "two-models", models={"a": str(tiny_model_dir),
                                                                     "b": str(tiny_model_dir)}))
    await agent.start()
    try:
        ids = prompt(48)
        client = connect(agent.address, PEER_TOKEN)
        await collect(client.generate(agent_pb2.GenerateRequest(model="a", prompt_ids=ids, sampling=sampling(2))))
        # the router's view of the heartbeat, as the registry passes it on
        report = SnapshotCapacity.model_validate((await agent.capacity()).to_json())
    finally:
        await agent.stop()
    held = set(prefix_hashes(ids, 16))
    assert held <= report.own("a").cached_hashes and not held & report.own("b").cached_hashes
    assert report.own("a").kv_blocks_total + report.own("b").kv_blocks_total == report.kv_blocks_total
