"""Store: sites, their state, roles and models; validation; audit; all-or-nothing writes."""

from __future__ import annotations

import pytest

from registry.errors import Conflict, InvalidInput, NotFound
from registry.records import LinkMeasurement, ModelServed, SiteSpec

from .conftest import capacity


def spec(**fields) -> SiteSpec:
    return SiteSpec(**{"region": "eu-west", "country": "de", "lat": 50.1, "lon": 8.7,
                       "grpc_address": "10.0.0.1:50051", **fields})


def test_create_and_get(store):
    created = store.sites.create("fra-1", spec(models=[ModelServed("llama-3-8b", "both")]), "alice")
    got = store.sites.get("fra-1")
    assert got == created
    assert (got.country, got.state, got.roles) == ("DE", "active", ["prefill", "decode"])
    assert got.models == [ModelServed("llama-3-8b", "both")]


@pytest.mark.parametrize("name", ["", "Fra-1", "fra_1", "a" * 64, "fra 1"])
def test_bad_site_names_are_refused(store, name):
    with pytest.raises(InvalidInput, match="site name"):
        store.sites.create(name, spec(), "alice")


@pytest.mark.parametrize("fields, message", [
    ({"lat": 91.0}, "lat must be between"),
    ({"lon": -180.5}, "lon must be between"),
    ({"lat": float("nan")}, "lat must be between"),
    ({"lat": 10.0, "lon": None}, "lat and lon together"),
    ({"country": "DEU"}, "ISO 3166-1"),
    ({"region": "EU West"}, "region"),
    ({"grpc_address": "10.0.0.1"}, "host:port"),
    ({"grpc_address": "host:70000"}, "host:port"),
    ({"roles": ["encode"]}, "roles"),
    ({"roles": []}, "roles"),
    ({"models": [ModelServed("m", "verify")]}, "model role"),
    ({"models": [ModelServed("m"), ModelServed("m")]}, "listed twice"),
    ({"heartbeat_interval_s": 0}, "heartbeat_interval_s"),
])
def test_bad_fields_are_refused_and_nothing_is_written(store, fields, message):
    with pytest.raises(InvalidInput, match=message):
        store.sites.create("fra-1", spec(**fields), "alice")
    with pytest.raises(NotFound):
        store.sites.get("fra-1")
    assert store.audit.list().items == []


def test_duplicate_name_conflicts(store):
    store.sites.create("fra-1", spec(), "alice")
    with pytest.raises(Conflict, match="already exists"):
        store.sites.create("fra-1", spec(region="eu-central"), "bob")
    assert store.sites.get("fra-1").region == "eu-west"


def test_ipv6_address_is_accepted(store):
    assert store.sites.create("fra-1", spec(grpc_address="[::1]:50051"), "a").grpc_address == "[::1]:50051"


def test_list_pages_by_name(store):
    for name in ["c-site", "a-site", "e-site", "b-site", "d-site"]:
        store.sites.create(name, spec(), "alice")
    first = store.sites.list(limit=2)
    second = store.sites.list(limit=2, cursor=first.next_cursor)
    third = store.sites.list(limit=2, cursor=second.next_cursor)
    names = [s.name for page in (first, second, third) for s in page.items]
    assert names == ["a-site", "b-site", "c-site", "d-site", "e-site"]
    assert third.next_cursor is None
    with pytest.raises(InvalidInput, match="limit"):
        store.sites.list(limit=0)


def test_put_creates_then_replaces_idempotently(store):
    site, created = store.sites.put("fra-1", spec(), "alice")
    assert created
    store.sites.cordon("fra-1", "alice")
    again, created = store.sites.put("fra-1", spec(region="eu-central", models=[ModelServed("m", "decode")]), "alice")
    assert not created
    assert (again.region, again.models, again.state) == ("eu-central", [ModelServed("m", "decode")], "cordoned")
    repeat, _ = store.sites.put("fra-1", spec(region="eu-central", models=[ModelServed("m", "decode")]), "alice")
    assert (repeat.region, repeat.models, repeat.created_at) == (again.region, again.models, site.created_at)


def test_update_changes_only_given_fields(store):
    store.sites.create("fra-1", spec(models=[ModelServed("m")]), "alice")
    updated = store.sites.update("fra-1", {"grpc_address": "10.0.0.2:1"}, "alice")
    assert (updated.grpc_address, updated.region, updated.models) == ("10.0.0.2:1", "eu-west", [ModelServed("m")])
    with pytest.raises(InvalidInput, match="unknown site fields"):
        store.sites.update("fra-1", {"state": "active"}, "alice")
    with pytest.raises(InvalidInput, match="lat"):
        store.sites.update("fra-1", {"lat": 100.0}, "alice")
    assert store.sites.get("fra-1").lat == 50.1
    with pytest.raises(NotFound, match="unknown site"):
        store.sites.update("nowhere", {"region": "x"}, "alice")


def test_state_changes(store, clock):
    store.sites.create("fra-1", spec(), "alice")
    assert store.sites.cordon("fra-1", "alice").state == "cordoned"
    drained = store.sites.drain("fra-1", 30.0, "alice")
    assert (drained.state, drained.drain_deadline) == ("draining", pytest.approx(clock.now + 30.0))
    back = store.sites.uncordon("fra-1", "alice")
    assert (back.state, back.drain_deadline) == ("active", None)
    with pytest.raises(InvalidInput, match="deadline_s"):
        store.sites.drain("fra-1", -1, "alice")
    with pytest.raises(NotFound):
        store.sites.cordon("nowhere", "alice")


def test_roles_and_models(store):
    store.sites.create("fra-1", spec(models=[ModelServed("old")]), "alice")
    assert store.sites.set_roles("fra-1", ["decode"], "alice").roles == ["decode"]
    models = [ModelServed("a", "prefill"), ModelServed("b", "decode")]
    assert store.sites.set_models("fra-1", models, "alice").models == models
    with pytest.raises(InvalidInput):
        store.sites.set_models("fra-1", [ModelServed("x"), ModelServed("x")], "alice")
    assert store.sites.get("fra-1").models == models  # the failed call wrote nothing


def test_delete_cascades(store):
    store.sites.create("fra-1", spec(), "alice")
    store.sites.create("ams-1", spec(), "alice")
    token = store.access.issue_site_token("fra-1", "alice")
    fra = store.access.site_for_token(token).site_id
    store.telemetry.record_heartbeat(fra, capacity(10, 5, 16))
    store.telemetry.record_links(fra, [LinkMeasurement("ams-1", 4.0, 1000.0)])
    store.sites.delete("fra-1", "alice", force=True)  # live: it heartbeated
    with pytest.raises(NotFound):
        store.sites.get("fra-1")
    assert store.access.site_for_token(token) is None
    snapshot = store.snapshot()
    assert len(snapshot.sites) == 1 and snapshot.links == "[]"
    with pytest.raises(NotFound):
        store.sites.delete("fra-1", "alice")


def test_every_change_is_audited_with_who_what_when(store, clock):
    store.sites.create("fra-1", spec(), "alice")
    clock.advance(1)
    store.sites.cordon("fra-1", "bob")
    store.sites.drain("fra-1", 10, "bob")
    store.sites.delete("fra-1", "carol")
    entries = store.audit.list().items
    assert [(e.actor, e.action, e.target) for e in entries] == [
        ("carol", "site.delete", "fra-1"), ("bob", "site.drain", "fra-1"),
        ("bob", "site.cordon", "fra-1"), ("alice", "site.create", "fra-1"),
    ]
    assert entries[2].at == pytest.approx(clock.now)
    assert entries[1].detail["state"] == "draining"
    page = store.audit.list(limit=3)
    assert [e.action for e in store.audit.list(limit=3, cursor=page.next_cursor).items] == ["site.create"]
