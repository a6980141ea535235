"""Per-model KV pools and prefix caches through the registry, on SQLite and PostgreSQL: an agent hosting
several models reports each one's own figures, the registry stores them and passes them to the routers'
snapshot, and a router places each model by its own pool and cache; old-format heartbeats still work."""

from __future__ import annotations

import json

import pytest

from engine.prefix_hash import prefix_hashes
from node_agent.heartbeat import ModelFigures, site_capacity_report
from registry.client import RegistryError
from registry.records import SiteSpec
from router.placement import CostModel, PlacementRequest, rank
from router.snapshot import parse_snapshot
from tests.agent.test_heartbeat_model_capacity import stats

from .conftest import capacity, new_site

FRANKFURT, AMSTERDAM, PARIS = (50.11, 8.68), (52.37, 4.90), (48.86, 2.35)
PROMPT = list(range(1, 2001))
SERVED = [{"model": "a"}, {"model": "b"}]


def hashes_of(ids: list[int]) -> list[str]:
    return [f"{h:016x}" for h in prefix_hashes(ids, 16)]


async def agent_site(admin, connect, name: str, where: tuple[float, float], models=SERVED):
    agent = await new_site(admin, connect, name, lat=where[0], lon=where[1])
    await agent.register_site(name, f"{name}:50051", models)
    return agent


async def placed(router_client, model: str, prompt: list[int] = PROMPT):
    snapshot = parse_snapshot((await router_client.snapshot())[0])
    return rank(snapshot, PlacementRequest(model, prompt, 128, *PARIS), CostModel(allow_split=False))


async def test_a_model_whose_own_pool_is_full_goes_elsewhere_and_the_other_comes(admin, connect, router_client):
    ams = await agent_site(admin, connect, "ams-1", AMSTERDAM)
    fra = await agent_site(admin, connect, "fra-1", FRANKFURT)
    # ams, nearer the client: a's pool full, b's empty; its sums (1000 of 2000 free) look roomy for both
    await ams.heartbeat(site_capacity_report(16, False, {"a": ModelFigures(stats(1000, 0)),
                                                         "b": ModelFigures(stats(1000, 1000))}).to_json())
    await fra.heartbeat(capacity(2000, 1000, 16, num_running=2).to_json())  # old format: sums only; same load
    assert [c.site_names for c in await placed(router_client, "a")] == [("fra-1", "fra-1")]
    assert (await placed(router_client, "b"))[0].site_names == ("ams-1", "ams-1")


async def test_a_prefix_cached_for_one_model_draws_only_that_models_requests(admin, connect, router_client):
    ams = await agent_site(admin, connect, "ams-1", AMSTERDAM)
    fra = await agent_site(admin, connect, "fra-1", FRANKFURT)
    await fra.heartbeat(site_capacity_report(16, False, {"a": ModelFigures(stats(1000, 1000), hashes_of(PROMPT)),
                                                         "b": ModelFigures(stats(1000, 1000))}).to_json())
    await ams.heartbeat(site_capacity_report(16, False, {"a": ModelFigures(stats(1000, 1000)),
                                                         "b": ModelFigures(stats(1000, 1000))}).to_json())
    for_a, for_b = (await placed(router_client, "a"))[0], (await placed(router_client, "b"))[0]
    # 1984: the engine reuses the 124 whole blocks before the one holding the last of the 2,000 tokens
    assert (for_a.site_names, for_a.num_cached_tokens) == (("fra-1", "fra-1"), 1984)
    assert (for_b.site_names, for_b.num_cached_tokens) == (("ams-1", "ams-1"), 0)


async def test_an_old_format_heartbeat_reads_as_it_always_did(admin, connect, router_client):
    fra = await agent_site(admin, connect, "fra-1", FRANKFURT, [{"model": "a"}])
    summary = {"block_size": 16, "hashes": hashes_of(PROMPT)}
    await fra.heartbeat({"kv_blocks_total": 1000, "kv_blocks_free": 900, "block_size": 16,
                         "prefix_cache_summary": summary})
    site = (await router_client.snapshot(packed=False))[0]["sites"][0]
    assert "models" not in site["capacity"] and site["capacity"]["prefix_cache_summary"] == summary
    chosen = (await placed(router_client, "a"))[0]
    assert (chosen.site_names, chosen.num_cached_tokens) == (("fra-1", "fra-1"), 1984)


async def test_a_heartbeat_with_a_bad_models_figure_is_refused_naming_it(admin, connect):
    fra = await agent_site(admin, connect, "fra-1", FRANKFURT)
    body = {"kv_blocks_total": 10, "kv_blocks_free": 10, "block_size": 16,
            "models": {"a": {"kv_blocks_total": 5, "kv_blocks_free": "5"}}}
    with pytest.raises(RegistryError) as refused:
        await fra.heartbeat(body)
    assert refused.value.status == 422 and refused.value.message.startswith("models.a.kv_blocks_free: must be an integer")


def test_six_models_each_keep_hashes_through_the_store(store):
    store.sites.create("fra-1", SiteSpec(lat=FRANKFURT[0], lon=FRANKFURT[1], grpc_address="fra-1:50051",
                                         models=[], heartbeat_interval_s=1.0), "alice")
    site_id = store.access.site_for_token(store.access.issue_site_token("fra-1", "alice")).site_id
    prompts = {f"m{i}": [i * 10_000 + t for t in range(4096 * 16)] for i in range(6)}
    figures = {model: ModelFigures(stats(5000, 5000), hashes_of(ids)) for model, ids in prompts.items()}
    store.telemetry.record_heartbeat(site_id, site_capacity_report(16, False, figures))
    doc = json.loads(store.snapshot().render(store.telemetry.now()))
    cap = parse_snapshot(doc).sites[0].capacity
    for model, ids in prompts.items():
        held = cap.own(model).cached_hashes
        assert len(held) >= 2730 and set(prefix_hashes(ids, 16)[:2730]) <= held  # the hashes it listed first
