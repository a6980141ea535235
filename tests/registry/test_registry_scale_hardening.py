"""Found under fleet load (hundreds of sites heartbeating, routers polling the snapshot, 2 replicas):
routers whose snapshot GETs queue behind one another must not each read every row again."""

from __future__ import annotations

import json

import pytest

from registry import snapshot_cache
from registry.metrics import RegistryMetrics
from registry.records import ModelServed, SiteSpec
from registry.snapshot_cache import SnapshotCache

from .conftest import capacity


@pytest.fixture
def fra(store):
    store.sites.create("fra-1", SiteSpec("eu-west", "DE", 50.1, 8.7, "10.0.0.1:1", ["prefill", "decode"],
                                         [ModelServed("llama", "both")]), "alice")
    return store.access.site_for_token(store.access.issue_site_token("fra-1", "alice")).site_id


def num_reads(metrics: RegistryMetrics) -> float:
    return metrics.snapshot_builds.labels("read")._value.get()


def test_a_get_that_waited_reuses_the_newer_snapshot_another_get_read(store, clock, fra, monkeypatch):
    """Router A reads the registry version; before A takes the cache's lock, another replica writes and
    router B's GET reads the newer rows. A must be served those, not read every row once more."""
    metrics = RegistryMetrics()
    cache = SnapshotCache(store.engine, clock=clock, metrics=metrics)
    cache.get()
    real_version = snapshot_cache.read_db_version
    raced = []

    def version_then_router_b(engine):
        version = real_version(engine)
        if not raced:
            raced.append(version)
            store.sites.cordon("fra-1", "bob")  # a write this process's commits do not account for
            cache.get()  # router B
        return version

    monkeypatch.setattr(snapshot_cache, "read_db_version", version_then_router_b)
    before = num_reads(metrics)
    answer = cache.get()  # router A
    assert num_reads(metrics) - before == 1  # B's read only
    assert json.loads(answer.body)["sites"][0]["state"] == "cordoned"


def test_a_database_whose_version_went_back_is_read_again(store, clock, fra, monkeypatch):
    """A restored backup can carry an older version than the cached data: the cache must read it, not
    keep serving rows the database no longer has."""
    cache = SnapshotCache(store.engine, clock=clock)
    store.telemetry.record_heartbeat(fra, capacity(100, 50, 16))
    assert json.loads(cache.get().body)["sites"][0]["capacity"] is not None
    with store.engine.begin() as conn:  # the restore: no capacity, and the version back to an older one
        conn.exec_driver_sql("DELETE FROM capacity")
        conn.exec_driver_sql("UPDATE registry_version SET version = 1")
    assert json.loads(cache.get().body)["sites"][0]["capacity"] is None
