"""Store: heartbeats (batched upserts), link measurements, deregistration, the snapshot version."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from registry.errors import InvalidInput, NotFound
from registry.records import ApiKeySpec, LinkMeasurement, SiteSpec
from registry.telemetry import HeartbeatWrite

from .conftest import capacity


@pytest.fixture
def sites(store):
    ids = {}
    for name in ("fra-1", "ams-1", "par-1"):
        store.sites.create(name, SiteSpec(heartbeat_interval_s=1.0), "alice")
        ids[name] = store.access.site_for_token(store.access.issue_site_token(name, "alice")).site_id
    return ids


def capacity_of(store, name: str) -> dict | None:
    site = next(s for s in json.loads(store.snapshot().render(store.telemetry.now()))["sites"] if s["name"] == name)
    return site["capacity"]


def test_heartbeat_upserts_latest_capacity(store, sites, clock):
    summary = {"block_size": 16, "hashes": ["000000000000a1b2", "000000000000c3d4"]}
    status = store.telemetry.record_heartbeat(sites["fra-1"], capacity(
        100, 40, 16, num_running=2, num_waiting=1, inflight_prefill_tokens=512, inflight_decode_tokens=64,
        prefill_tokens_per_s=9000.0, decode_tokens_per_s=120.0, prefix_cache_summary=summary))
    assert (status.state, status.drain_deadline) == ("active", None)
    clock.advance(1)
    store.telemetry.record_heartbeat(sites["fra-1"], capacity(100, 30, 16, draining=True))
    cap = capacity_of(store, "fra-1")
    assert (cap["kv_blocks_free"], cap["draining"], cap["prefix_cache_summary"]) == (30, True, None)
    assert cap["reported_at"] == pytest.approx(clock.now)


def test_heartbeat_reports_operator_intent(store, sites):
    store.sites.drain("fra-1", 60, "alice")
    status = store.telemetry.record_heartbeat(sites["fra-1"], capacity(1, 1, 1))
    assert status.state == "draining" and status.drain_deadline is not None
    assert store.sites.get("fra-1").state == "draining"  # a heartbeat never rewrites the operator's state


def test_batch_keeps_last_heartbeat_per_site_and_drops_deleted_sites(store, sites, clock):
    store.sites.delete("par-1", "alice")
    writes = [HeartbeatWrite(sites["fra-1"], capacity(10, 1, 16), clock.now),
              HeartbeatWrite(sites["ams-1"], capacity(10, 2, 16), clock.now),
              HeartbeatWrite(sites["par-1"], capacity(10, 3, 16), clock.now),
              HeartbeatWrite(sites["fra-1"], capacity(10, 9, 16), clock.now)]
    statuses = store.telemetry.record_heartbeats(writes)
    assert set(statuses) == {sites["fra-1"], sites["ams-1"]}
    assert capacity_of(store, "fra-1")["kv_blocks_free"] == 9
    with pytest.raises(NotFound):
        store.telemetry.record_heartbeat(sites["par-1"], capacity(1, 1, 1))


@pytest.mark.parametrize("fields, message", [
    ((10, 11, 16), "cannot exceed"),
    ((10, 5, 0), "block_size"),
    ((-1, 0, 16), "kv_blocks_total"),
    ((10, 5, 16, {"num_waiting": -1}), "num_waiting"),
    ((10, 5, 16, {"decode_tokens_per_s": float("inf")}), "decode_tokens_per_s"),
    ((10, 5, 16, {"prefix_cache_summary": ["not", "an", "object"]}), "prefix_cache_summary"),
])
def test_bad_heartbeats_cannot_be_built(fields, message):
    """The wire contract checks a heartbeat when it is built, so the store is never handed a bad one."""
    *counts, extra = fields if isinstance(fields[-1], dict) else (*fields, {})
    with pytest.raises(ValidationError, match=message):
        capacity(*counts, **extra)


def test_links_are_upserted_all_or_nothing(store, sites):
    stored = store.telemetry.record_links(sites["fra-1"], [LinkMeasurement("ams-1", 5.0, 1000.0),
                                                          LinkMeasurement("par-1", 9.0, 400.0)])
    assert stored == 2
    store.telemetry.record_links(sites["fra-1"], [LinkMeasurement("ams-1", 6.0, 900.0)])
    links = json.loads(store.snapshot().links)
    assert [(l["src"], l["dst"], l["rtt_ms"]) for l in links] == [("fra-1", "ams-1", 6.0), ("fra-1", "par-1", 9.0)]
    with pytest.raises(InvalidInput, match="unknown peer"):
        store.telemetry.record_links(sites["fra-1"], [LinkMeasurement("ams-1", 1.0, 1.0), LinkMeasurement("zzz", 1.0, 1.0)])
    with pytest.raises(InvalidInput, match="itself"):
        store.telemetry.record_links(sites["fra-1"], [LinkMeasurement("fra-1", 1.0, 1.0)])
    with pytest.raises(InvalidInput, match="rtt_ms"):
        store.telemetry.record_links(sites["fra-1"], [LinkMeasurement("ams-1", -1.0, 1.0)])
    assert json.loads(store.snapshot().links)[0]["rtt_ms"] == 6.0


def test_clear_capacity_marks_site_down(store, sites):
    store.telemetry.record_heartbeat(sites["fra-1"], capacity(10, 5, 16))
    store.telemetry.clear_capacity(sites["fra-1"])
    assert capacity_of(store, "fra-1") is None


def test_version_moves_on_every_visible_change(store, sites):
    seen = [store.version()]

    def changed() -> bool:
        seen.append(store.version())
        return seen[-1] > seen[-2]

    store.telemetry.record_heartbeat(sites["fra-1"], capacity(10, 5, 16))
    assert changed()
    store.telemetry.record_links(sites["fra-1"], [LinkMeasurement("ams-1", 1.0, 1.0)])
    assert changed()
    store.sites.cordon("ams-1", "alice")
    assert changed()
    store.sites.set_models("ams-1", [], "alice")
    assert changed()
    store.access.create_api_key(ApiKeySpec("k"), "alice")
    assert not changed()  # API keys are not part of the snapshot
