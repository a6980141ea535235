"""Issue 17, defects 1 and 2 (registry side): one site's heartbeat can neither poison the snapshot
nor fail other sites' heartbeats.

Every heartbeat field is validated strictly against the wire contract (registry.wire) before it is
queued; a row the database still refuses fails alone, never its batch-mates in the group commit;
each rejection is logged in one line, rate-limited.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest
from pydantic import ValidationError

from registry.client import RegistryError
from registry.records import SiteSpec
from registry.service import create_app
from registry.telemetry import HeartbeatWrite, capacity_row
from registry.wire import MAX_BLOCK_SIZE, MAX_CACHE_HASHES, MAX_INT32, MAX_JSON_INT, MAX_TOKENS_PER_S, CapacityReport

from .conftest import new_site
from .test_service_agent import CAPACITY, site_in

HASH = "0123456789abcdef"


def summary(*hashes, block_size=16) -> dict:
    return {"prefix_cache_summary": {"block_size": block_size, "hashes": list(hashes)}}


POISON = {
    "hash not hex": summary("zz"),
    "hash too short": summary("9f86d081"),
    "hash upper case": summary(HASH.upper()),
    "hash not a string": summary(12345),
    "summary block size 0": summary(HASH, block_size=0),
    "summary block size text": summary(HASH, block_size="16"),
    "summary without block size": {"prefix_cache_summary": {"hashes": [HASH]}},
    "summary with unknown field": {"prefix_cache_summary": {"block_size": 16, "hashes": [], "extra": 1}},
    "blocks beyond int64": {"kv_blocks_total": 2**63, "kv_blocks_free": 0},
    "blocks beyond 2**53": {"kv_blocks_total": MAX_JSON_INT + 1, "kv_blocks_free": 0},
    "tokens beyond int64": {"inflight_decode_tokens": 2**63},
    "running beyond int32": {"num_running": MAX_INT32 + 1},
    "block size beyond range": {"block_size": MAX_BLOCK_SIZE + 1},
    "count as text": {"num_running": "5"},
    "count as bool": {"num_waiting": True},
    "count as float": {"kv_blocks_total": 4096.0},
    "draining as int": {"draining": 1},
    "rate too large": {"prefill_tokens_per_s": MAX_TOKENS_PER_S * 10},
    "no tensor-parallel ranks": {"tensor_parallel_size": 0},
    "pipeline stages as text": {"pipeline_parallel_size": "2"},
    "no expert-parallel ranks": {"expert_parallel_size": 0},
    "negative GPU count": {"num_gpus": -1},
    "acceptance above one": {"speculative_acceptance": 1.5},
}


async def test_poisoned_heartbeats_are_422_and_the_last_good_one_stays(admin, connect, router_client):
    agent = await new_site(admin, connect)
    good = {**CAPACITY, **summary(HASH)}
    await agent.heartbeat(good)
    for case, change in POISON.items():
        with pytest.raises(RegistryError) as err:
            await agent.heartbeat({**good, **change})
        assert err.value.status == 422, (case, err.value)
    assert site_in((await router_client.snapshot(packed=False))[0],
                   "fra-1")["capacity"]["prefix_cache_summary"]["hashes"] == [HASH]


def test_every_bound_fits_the_database(store):
    """The largest values the contract allows are stored and read back exactly (both databases)."""
    store.sites.create("fra-1", SiteSpec(), "alice")
    largest = {"kv_blocks_total": MAX_JSON_INT, "kv_blocks_free": MAX_JSON_INT, "block_size": MAX_BLOCK_SIZE,
               "num_running": MAX_INT32, "num_waiting": MAX_INT32, "inflight_prefill_tokens": MAX_JSON_INT,
               "inflight_decode_tokens": MAX_JSON_INT, "prefill_tokens_per_s": MAX_TOKENS_PER_S,
               "decode_tokens_per_s": MAX_TOKENS_PER_S, "draining": True, "num_gpus": MAX_INT32,
               "tensor_parallel_size": MAX_INT32, "pipeline_parallel_size": MAX_INT32, "expert_parallel_size": MAX_INT32,
               "speculative_acceptance": 1.0,
               **summary(*[f"{i:016x}" for i in range(MAX_CACHE_HASHES)], block_size=MAX_BLOCK_SIZE)}
    store.telemetry.record_heartbeat(store.sites.get("fra-1").id, CapacityReport.model_validate(largest))
    site = json.loads(store.snapshot().render(store.telemetry.now()))["sites"][0]
    assert {k: site["capacity"][k] for k in largest} == largest


def test_the_hash_list_is_capped():
    with pytest.raises(ValidationError, match="prefix_cache_summary.hashes"):
        CapacityReport.model_validate({**CAPACITY, **summary(*[HASH] * (MAX_CACHE_HASHES + 1))})


async def test_a_row_the_database_refuses_fails_alone(app, admin, connect, router_client):
    """Even a row that slipped past validation (here: handed to the batcher directly) cannot fail
    the heartbeats committed with it."""
    service = app.state.registry
    ids = {}
    for name in ("fra-1", "ams-1", "par-1"):
        await (await new_site(admin, connect, name)).heartbeat(CAPACITY)
        ids[name] = service.store.sites.get(name).id
    now = service.store.telemetry.now()

    def row(name: str, **change) -> dict:
        write = HeartbeatWrite(ids[name], CapacityReport.model_validate({**CAPACITY, "kv_blocks_free": 7}), now)
        return {**capacity_row(write), **change}  # every column, as the service builds it

    results = await asyncio.gather(service.batcher.submit(row("fra-1")),
                                   service.batcher.submit(row("ams-1", kv_blocks_total=2**63)),
                                   service.batcher.submit(row("par-1")), return_exceptions=True)
    assert [type(r).__name__ for r in results] == ["SiteStatus", "InvalidInput", "SiteStatus"]
    snapshot = (await router_client.snapshot())[0]
    assert [site_in(snapshot, n)["capacity"]["kv_blocks_free"] for n in ("fra-1", "ams-1", "par-1")] == [7, 1024, 7]


async def test_rejections_are_logged_once_per_site_and_interval(admin, connect, caplog):
    agent = await new_site(admin, connect)
    caplog.set_level(logging.INFO)
    for _ in range(20):
        with pytest.raises(RegistryError):
            await agent.heartbeat({**CAPACITY, **summary("zz")})
    lines = [r for r in caplog.records if "fra-1" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and lines[0].exc_info is None
    assert "prefix_cache_summary" in lines[0].getMessage()


def test_the_spec_describes_the_heartbeat_with_the_contract(tmp_path):
    """The heartbeat is read outside FastAPI; its body schema still comes from the wire contract,
    and every schema it refers to is in the spec (schema-driven fuzzers resolve them)."""
    spec = create_app(f"sqlite:///{tmp_path / 'registry.db'}", "admin", "router").openapi()
    body = spec["paths"]["/v1/agent/heartbeat"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CapacityReport"}
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(spec)))
    assert {"CapacityReport", "PrefixCacheSummary"} <= refs <= set(spec["components"]["schemas"])
    assert spec["components"]["schemas"]["PrefixCacheSummary"]["properties"]["hashes"]["maxItems"] == MAX_CACHE_HASHES
