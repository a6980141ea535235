"""Which roles a site offers: one rule (registry.wire.RoleOffer), computed by the registry and published
as each site's `role_offer`; the store, the planner, `edgefire status`, the dashboard and the routers
all read it, so they agree on a mixed fleet, on SQLite and PostgreSQL."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy.cluster import site_role, status_table
from registry.errors import InvalidInput
from registry.planner import Planner, PlannerSettings, plan, pool_sites
from registry.records import ModelServed, SiteSpec
from registry.sites import offers_both_roles
from registry.snapshot_cache import SnapshotCache
from registry.telemetry import HeartbeatWrite
from router.snapshot import parse_snapshot

from .conftest import capacity

DASHBOARD_JS = Path(__file__).parents[2] / "registry" / "dashboard" / "dashboard.js"
SETTINGS = PlannerSettings(min_dwell_s=60.0, settle_s=5.0)
BOTH_ROLES = ["prefill", "decode"]

# name -> (region, allowed roles, models, what a user expects: roles per model now, status/dashboard text, flexible)
FLEET = {
    "pre": ("eu", BOTH_ROLES, [ModelServed("m", "prefill")], {"m": ["prefill"]}, "prefill", False),
    "dec": ("eu", BOTH_ROLES, [ModelServed("m", "decode")], {"m": ["decode"]}, "decode", False),
    "switched": ("eu", BOTH_ROLES, [ModelServed("m", "both")], {"m": ["prefill"]}, "both (now prefill)", True),
    "flex": ("us", BOTH_ROLES, [ModelServed("m", "both")], {"m": BOTH_ROLES}, "both", True),
    "bare": ("us", BOTH_ROLES, [], {}, "none", False),
    "cordoned": ("us", BOTH_ROLES, [ModelServed("m", "both")], {"m": BOTH_ROLES}, "both", True),
    "decode-allowed": ("us", ["decode"], [ModelServed("m", "both")], {"m": ["decode"]}, "decode", False),
    "two-models": ("us", BOTH_ROLES, [ModelServed("m", "prefill"), ModelServed("n", "decode")],
                   {"m": ["prefill"], "n": ["decode"]}, "both", True),
}
PREFILL_HEAVY = {"pre": dict(inflight_prefill_tokens=40_000, prefill_tokens_per_s=4000.0),
                 "switched": dict(inflight_prefill_tokens=8000, prefill_tokens_per_s=4000.0)}


@pytest.fixture
def fleet(store, clock):
    """The fleet, every site heartbeating; the real planner narrows `switched` to prefill (eu is
    prefill-heavy); `cordoned` is cordoned by the operator."""
    for name, (region, roles, models, *_) in FLEET.items():
        store.sites.create(name, SiteSpec(region, "PT", 38.7, -9.1, f"{name}:1", roles, models), "ops")
    ids = {name: store.access.site_for_token(store.access.issue_site_token(name, "ops")).site_id for name in FLEET}
    store.sites.cordon("cordoned", "ops")
    snapshots = SnapshotCache(store.engine, clock=clock, max_body_age_s=0.0)
    planner = Planner(store, lambda: snapshots.get().body, SETTINGS, clock=clock)
    store.telemetry.record_heartbeats([HeartbeatWrite(site_id, capacity(1000, 900, 16, **PREFILL_HEAVY.get(name, {})),
                                                      clock.now) for name, site_id in ids.items()])
    assert [(c.site, c.role) for c in planner.tick()] == [("switched", "prefill")]
    return snapshots


def router_view(doc: dict) -> dict:
    return {site.name: {model: [r for r in BOTH_ROLES if site.serves(model, r)] for model in site.models}
            for site in parse_snapshot(doc).sites}


def planner_view(doc: dict) -> dict:
    return {site.name: ({model: [r for r in BOTH_ROLES if site.does_for(r, model)] for model in site.models},
                        site.flexible) for site in pool_sites(doc)}


def dashboard_view(sites: list[dict]) -> dict:
    """role() and roleText() of the dashboard's own script, run in node over the admin API's sites."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the dashboard's script cannot run outside a browser")
    harness = ("const vm = require('vm'), fs = require('fs');"
               "const context = { document: { addEventListener() {} }, sessionStorage: { getItem() { return null; } } };"
               "vm.createContext(context); vm.runInContext(fs.readFileSync(process.argv[1], 'utf8'), context);"
               "const sites = JSON.parse(fs.readFileSync(0, 'utf8'));"
               "process.stdout.write(JSON.stringify(sites.map(s => [s.name, context.role(s), context.roleText(s)])));")
    done = subprocess.run([node, "-e", harness, str(DASHBOARD_JS)], input=json.dumps(sites), capture_output=True,
                          text=True, timeout=30, check=True)
    return {name: (marker, text) for name, marker, text in json.loads(done.stdout)}


async def test_every_view_of_a_sites_roles_agrees_on_a_mixed_fleet(fleet, store, admin):
    routers_doc = json.loads(fleet.get().body)
    admin_doc = await admin.admin_snapshot()
    admin_sites = {site["name"]: site for site in (await admin.list_sites())["items"]}

    published = {site["name"]: site["role_offer"] for site in routers_doc["sites"]}
    expected = {name: {"roles": [r for r in BOTH_ROLES if any(r in rs for rs in by_model.values())],
                       "by_model": by_model, "flexible": flexible}
                for name, (_, _, _, by_model, _, flexible) in FLEET.items()}
    assert published == expected
    assert {site["name"]: site["role_offer"] for site in admin_doc["sites"]} == expected
    assert {name: site["role_offer"] for name, site in admin_sites.items()} == expected

    assert router_view(routers_doc) == {name: by_model for name, (*_, by_model, _, _) in FLEET.items()}
    assert planner_view(routers_doc) == {name: (by_model, flexible) for name, (*_, by_model, _, flexible)
                                         in FLEET.items()}
    status_texts = {site["name"]: site_role(site) for site in admin_doc["sites"]}
    assert status_texts == {name: text for name, (*_, text, _) in FLEET.items()}
    assert {name: text for name, (_, text) in dashboard_view(admin_doc["sites"]).items()} == status_texts
    assert {name: marker for name, (marker, _) in dashboard_view(admin_doc["sites"]).items()} == {
        "pre": "prefill", "dec": "decode", "switched": "prefill", "flex": "both", "bare": "none",
        "cordoned": "both", "decode-allowed": "decode", "two-models": "both"}
    cordoned_row = next(line for line in status_table(admin_doc["sites"]).splitlines() if line.startswith("cordoned"))
    assert (cordoned_row.split()[1], cordoned_row.split()[3]) == ("cordoned", "both")  # its state is its own column

    # The store lets the planner narrow exactly the sites the snapshot calls flexible.
    assert {name: offers_both_roles(site.roles, site.models) for name in FLEET
            for site in [store.sites.get(name)]} == {name: flexible for name, (*_, flexible) in FLEET.items()}


def test_a_site_serving_no_model_offers_no_role_and_the_planner_cannot_narrow_it(fleet, store):
    """The store used to take a site with no models at its allowed roles and let it be narrowed, while
    the planner and routers gave it nothing: now it offers nothing everywhere."""
    with pytest.raises(InvalidInput, match="serves no model yet, so it offers no role") as refused:
        store.sites.set_active_role("bare", "prefill", "planner", {"reason": "test"})
    assert refused.value.code == "fixed_role"
    assert store.sites.get("bare").active_role is None


def test_every_reader_takes_the_published_offer_as_it_stands():
    """The registry's field is the answer: a reader that re-derived it from roles and models would
    disagree with this (deliberately different) published offer."""
    site = {"name": "x", "region": "r", "state": "active", "alive": True, "grpc_address": "x:1", "roles": BOTH_ROLES,
            "models": [{"model": "m", "role": "both"}], "active_role": None, "active_role_since": None,
            "role_offer": {"roles": ["decode"], "by_model": {"m": ["decode"]}, "flexible": False},
            "heartbeat_age_s": 1.0, "capacity": {"kv_blocks_total": 10, "kv_blocks_free": 10, "block_size": 16}}
    doc = {"version": "1", "generated_at": 1.0, "sites": [site], "links": []}
    assert router_view(doc) == {"x": {"m": ["decode"]}}
    assert planner_view(doc) == {"x": ({"m": ["decode"]}, False)}
    assert site_role(site) == "decode"
    assert dashboard_view([site]) == {"x": ("decode", "decode")}


def test_a_snapshot_from_a_registry_older_than_the_field_is_read_by_the_same_rule(fleet, clock):
    """Routers (and `edgefire status`) upgraded before the registry read its snapshot without
    `role_offer`: they derive what the registry would have published."""
    doc = json.loads(fleet.get().body)
    older = copy.deepcopy(doc)
    for site in older["sites"]:
        del site["role_offer"]
    assert router_view(older) == router_view(doc)
    assert [site_role(site) for site in older["sites"]] == [site_role(site) for site in doc["sites"]]
    assert planner_view(older) == planner_view(doc)
    later = clock.now + SETTINGS.min_dwell_s  # past dwell and settle: the planner would move a site again
    assert plan(older, later, SETTINGS) == plan(doc, later, SETTINGS)


def test_a_malformed_published_offer_leaves_only_that_site_out_of_the_routers_snapshot():
    def site(name, offer):
        return {"name": name, "state": "active", "alive": True, "grpc_address": f"{name}:1",
                "models": [{"model": "m", "role": "both"}], "role_offer": offer}
    doc = {"version": "1", "generated_at": 1.0, "links": [], "sites": [
        site("good", {"roles": ["prefill"], "by_model": {"m": ["prefill"]}, "flexible": False}),
        site("bad-role", {"roles": ["both"], "by_model": {"m": ["both"]}, "flexible": False}),
        site("bad-shape", {"by_model": ["m"], "flexible": False}),
        site("not-an-object", "prefill")]}
    assert [s.name for s in parse_snapshot(doc).sites] == ["good"]
