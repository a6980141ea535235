"""The routers' snapshot: shape, liveness against the TTL, and the version/ETag behaviour."""

from __future__ import annotations

import json

import pytest

from registry.db import make_engine
from registry.records import ModelServed, SiteSpec
from registry.snapshot_cache import SnapshotCache
from registry.store import RegistryStore

from .conftest import capacity

SITE_KEYS = {"name", "region", "country", "lat", "lon", "grpc_address", "state", "roles", "active_role",
             "active_role_since", "models", "role_offer", "alive",
             "heartbeat_age_s", "capacity"}
CAPACITY_KEYS = {"kv_blocks_total", "kv_blocks_free", "block_size", "num_running", "num_waiting",
                 "inflight_prefill_tokens", "inflight_decode_tokens", "prefill_tokens_per_s", "decode_tokens_per_s",
                 "decode_batch_size", "decode_kv_tokens", "prefix_cache_summary", "draining", "reported_at",
                 "num_gpus", "tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size",
                 "speculative_acceptance"}


@pytest.fixture
def fra(store):
    store.sites.create("fra-1", SiteSpec("eu-west", "DE", 50.1, 8.7, "10.0.0.1:1", ["prefill", "decode"],
                                         [ModelServed("llama", "both")], heartbeat_interval_s=2.0), "alice")
    store.sites.create("ams-1", SiteSpec(), "alice")
    return store.access.site_for_token(store.access.issue_site_token("fra-1", "alice")).site_id


def rendered(store, clock) -> dict:
    return json.loads(store.snapshot().render(clock.now))


def test_shape(store, clock, fra):
    summary = {"block_size": 16, "hashes": ["00000000000000ff", "000000000000abcd"]}
    store.telemetry.record_heartbeat(fra, capacity(100, 50, 16, prefix_cache_summary=summary))
    snap = rendered(store, clock)
    assert set(snap) == {"version", "generated_at", "sites", "links"}
    assert isinstance(snap["version"], str) and snap["generated_at"] == pytest.approx(clock.now)
    ams, fra_site = snap["sites"]
    assert set(fra_site) == SITE_KEYS and set(fra_site["capacity"]) == CAPACITY_KEYS
    assert fra_site["models"] == [{"model": "llama", "role": "both"}]
    assert fra_site["capacity"]["prefix_cache_summary"] == summary
    assert (fra_site["alive"], fra_site["heartbeat_age_s"]) == (True, 0.0)
    assert (ams["alive"], ams["heartbeat_age_s"], ams["capacity"]) == (False, None, None)


def test_site_is_down_after_three_heartbeat_intervals(store, clock, fra):
    store.telemetry.record_heartbeat(fra, capacity(100, 50, 16))
    data = store.snapshot()
    clock.advance(5.9)  # TTL = 3 x 2 s
    assert json.loads(data.render(clock.now))["sites"][1]["alive"] is True
    before = data.version_at(clock.now)
    clock.advance(0.2)
    site = json.loads(data.render(clock.now))["sites"][1]
    assert site["alive"] is False and site["heartbeat_age_s"] == pytest.approx(6.1)
    assert data.version_at(clock.now) != before  # liveness flips change the version


def test_cache_answers_304_until_something_changes(store, clock, fra):
    cache = SnapshotCache(store.engine, clock=clock)
    first = cache.get()
    assert first.body is not None and json.loads(first.body)["version"] == first.etag.strip('"')
    assert cache.get(first.etag).body is None
    assert cache.get(f'W/{first.etag}, "other"').body is None
    store.telemetry.record_heartbeat(fra, capacity(100, 50, 16))
    second = cache.get(first.etag)
    assert second.body is not None and second.etag != first.etag
    clock.advance(60)  # the heartbeat expires: same rows, new liveness
    third = cache.get(second.etag)
    assert third.body is not None and json.loads(third.body)["sites"][1]["alive"] is False


def test_cached_body_is_refreshed_for_heartbeat_ages(store, clock, fra):
    store.telemetry.record_heartbeat(fra, capacity(100, 50, 16))
    cache = SnapshotCache(store.engine, clock=clock, max_body_age_s=1.0)
    first = cache.get()
    clock.advance(0.5)
    assert cache.get().body is first.body  # served from cache
    clock.advance(1.0)
    assert json.loads(cache.get().body)["sites"][1]["heartbeat_age_s"] == pytest.approx(1.5)


def test_cache_follows_own_heartbeats_and_other_replicas_writes(store, clock, fra, db_url):
    """Own heartbeat commits are applied without a read; another replica's writes still appear."""
    cache = SnapshotCache(store.engine, clock=clock)
    store.telemetry.capacity_listeners.append(cache.capacity_written)
    cache.get()
    other = RegistryStore(make_engine(db_url), clock)  # a second replica on the same database
    try:
        ams = other.access.site_for_token(other.access.issue_site_token("ams-1", "bob")).site_id
        steps = [lambda: store.telemetry.record_heartbeat(fra, capacity(100, 50, 16, prefix_cache_summary={"block_size": 16, "hashes": ["000000000000000a"]})),
                 lambda: store.telemetry.record_heartbeat(fra, capacity(100, 40, 16)),
                 lambda: other.telemetry.record_heartbeat(ams, capacity(10, 5, 16)),
                 lambda: store.telemetry.record_heartbeat(fra, capacity(100, 30, 16)),
                 lambda: other.sites.cordon("fra-1", "bob"),
                 lambda: store.telemetry.record_heartbeat(ams, capacity(10, 1, 16))]
        for step in steps:
            step()
            clock.advance(0.25)
            assert cache.get().body == store.snapshot().render(clock.now)
        clock.advance(60)  # every heartbeat expires
        assert cache.get().body == store.snapshot().render(clock.now)
    finally:
        other.close()



def test_registry_back_from_an_outage_gives_live_sites_one_liveness_window(store, clock, fra):
    """Sites alive when the registry went away are not declared dead the moment it returns (their
    heartbeats were backing off): each gets one liveness window from the return."""
    store.telemetry.record_heartbeat(fra, capacity(100, 50, 16))
    down_at = clock.now
    clock.advance(60.0)  # the registry is down for a minute; a new process starts on the same database
    cache = SnapshotCache(store.engine, clock=clock)
    fra_site = json.loads(cache.get().body)["sites"][1]
    assert (fra_site["alive"], fra_site["heartbeat_age_s"]) == (True, 0.0)
    assert fra_site["capacity"]["reported_at"] == pytest.approx(down_at)  # the real report time is kept
    clock.advance(5.9)
    assert json.loads(cache.get().body)["sites"][1]["alive"] is True
    clock.advance(0.2)  # one window (3 x 2 s) after the return, with no heartbeat: down
    assert json.loads(cache.get().body)["sites"][1]["alive"] is False


def test_site_dead_before_the_registry_went_away_stays_dead_after_it_returns(store, clock, fra):
    ams = store.access.site_for_token(store.access.issue_site_token("ams-1", "alice")).site_id
    store.telemetry.record_heartbeat(ams, capacity(100, 50, 16))
    clock.advance(10.0)  # ams-1 (TTL 6 s) is dead when fra-1 reports last before the outage
    store.telemetry.record_heartbeat(fra, capacity(100, 50, 16))
    clock.advance(60.0)
    ams_site, fra_site = json.loads(SnapshotCache(store.engine, clock=clock).get().body)["sites"]
    assert ams_site["alive"] is False and fra_site["alive"] is True
