"""The prefill/decode planner: load shifts move flexible sites between the pools, with hysteresis
and a minimum dwell time (a fake clock, no sleeping); every change is audited; one planner at a time."""

from __future__ import annotations

import json
import re

import pytest

import typed_config

from registry.errors import InvalidInput
from registry.planner import Planner, PlannerSettings, plan
from registry.records import ModelServed, SiteSpec
from registry.snapshot_cache import SnapshotCache
from registry.telemetry import HeartbeatWrite
from router.snapshot import Site as RouterSite
from router.snapshot import parse_site
from typed_config import ConfigError

from .conftest import capacity

SETTINGS = PlannerSettings(min_dwell_s=60.0, settle_s=5.0)
PREFILL_HEAVY = {"pre": dict(inflight_prefill_tokens=40_000, prefill_tokens_per_s=4000.0),
                 "dec": dict(num_running=2, decode_tokens_per_s=500.0),
                 "flex": dict(inflight_prefill_tokens=8000, prefill_tokens_per_s=4000.0)}
DECODE_HEAVY = {"pre": dict(prefill_tokens_per_s=4000.0),
                "dec": dict(num_running=150, decode_tokens_per_s=500.0),
                "flex": dict(num_running=40, decode_tokens_per_s=500.0)}
CALM = {"pre": {}, "dec": {}, "flex": {}}


class Region:
    """Three sites in one region: prefill-only, decode-only, and one allowed both."""

    def __init__(self, store, clock):
        self.store, self.clock = store, clock
        self.site_ids = {}
        for name, role in (("pre", "prefill"), ("dec", "decode"), ("flex", "both")):
            spec = SiteSpec("eu-west", "PT", 38.7, -9.1, f"{name}:1", ["prefill", "decode"], [ModelServed("m", role)])
            store.sites.create(name, spec, "ops")
            token = store.access.issue_site_token(name, "ops")
            self.site_ids[name] = store.access.site_for_token(token).site_id
        self.snapshots = SnapshotCache(store.engine, clock=clock, max_body_age_s=0.0)
        self.planner = Planner(store, lambda: self.snapshots.get().body, SETTINGS, clock=clock)

    def load(self, load: dict) -> None:
        self.store.telemetry.record_heartbeats([HeartbeatWrite(self.site_ids[name], capacity(1000, 900, 16, **figures),
                                                               self.clock.now) for name, figures in load.items()])

    def run(self, load: dict, seconds: float, step_s: float = 2.0) -> list[tuple[float, str, str]]:
        """Heartbeats with this load and a planner tick every step_s; the changes made, with their times."""
        changes = []
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.load(load)
            changes += [(self.clock.now, c.site, c.role or "both") for c in self.planner.tick()]
            self.clock.advance(step_s)
        return changes

    def active_role(self, name: str) -> str | None:
        return self.store.sites.get(name).active_role


@pytest.fixture
def region(store, clock):
    return Region(store, clock)


def test_a_load_shift_flips_the_flexible_site_and_back_never_faster_than_the_dwell(region, store):
    start = region.clock.now
    changes = region.run(PREFILL_HEAVY, 4)
    assert [(site, role) for _, site, role in changes] == [("flex", "prefill")]
    assert region.active_role("flex") == "prefill"
    first_at = changes[0][0]

    changes = region.run(DECODE_HEAVY, 70)
    assert [(site, role) for _, site, role in changes] == [("flex", "decode")]
    assert changes[0][0] - first_at >= SETTINGS.min_dwell_s  # pressure said "decode" 4 s in; the dwell held it
    assert changes[0][0] - first_at <= SETTINGS.min_dwell_s + 2  # and no longer than one tick past it

    changes = region.run(PREFILL_HEAVY, 70)
    assert [(site, role) for _, site, role in changes] == [("flex", "prefill")]

    changes = region.run(CALM, 70)
    assert [(site, role) for _, site, role in changes] == [("flex", "both")]
    assert region.active_role("flex") is None

    audit = [e for e in store.audit.list(100).items if e.action == "site.active_role"]
    assert [(e.target, e.detail["from"], e.detail["to"]) for e in reversed(audit)] == [
        ("flex", "both", "prefill"), ("flex", "prefill", "decode"), ("flex", "decode", "prefill"),
        ("flex", "prefill", "both")]
    assert all(e.actor == "planner" and e.detail["reason"] and e.at >= start for e in audit)
    assert audit[-1].detail["prefill_backlog_s"] > 1.0  # the first change, and the figures behind it


def test_the_band_between_low_and_high_holds_the_state(region):
    region.run(PREFILL_HEAVY, 5)
    assert region.active_role("flex") == "prefill"
    # Backlog falls to 0.75 of target: under "high", above "low": no flip back, however long it lasts.
    middling = {"pre": dict(inflight_prefill_tokens=6000, prefill_tokens_per_s=4000.0), "dec": {}, "flex": {}}
    assert region.run(middling, 150, step_s=10.0) == []
    assert region.active_role("flex") == "prefill"


def test_the_snapshot_and_the_agents_heartbeat_answer_carry_the_active_role(region, store):
    region.run(PREFILL_HEAVY, 2)
    site = next(s for s in json.loads(region.snapshots.get().body)["sites"] if s["name"] == "flex")
    assert site["active_role"] == "prefill" and site["active_role_since"] is not None
    status = store.telemetry.record_heartbeat(region.site_ids["flex"], capacity(1000, 900, 16))
    assert status.to_json()["active_role"] == "prefill"


def test_a_site_is_never_narrowed_when_no_other_site_keeps_the_role(region, store):
    store.sites.cordon("dec", "ops")  # flex is now the region's only decode site
    assert region.run(PREFILL_HEAVY, 30) == []
    assert region.active_role("flex") is None


def test_dry_run_only_logs(region, store, caplog):
    region.planner.settings = PlannerSettings(min_dwell_s=60.0, settle_s=5.0, dry_run=True)
    with caplog.at_level("INFO", logger="registry.planner"):
        changes = region.run(PREFILL_HEAVY, 30)
    assert [(site, role) for _, site, role in changes] == [("flex", "prefill")]  # decided once, not every tick
    assert "would set flex (eu-west) to prefill" in caplog.text
    assert region.active_role("flex") is None
    assert not [e for e in store.audit.list(100).items if e.action == "site.active_role"]


def test_one_planner_at_a_time(region, store, clock):
    other = Planner(store, region.planner.read_snapshot, SETTINGS, clock=clock)
    region.load(PREFILL_HEAVY)
    assert region.planner.tick()  # holds the lease now
    assert other.tick() == [] and other.num_changes == 0
    clock.advance(3 * SETTINGS.interval_s + 1)  # the first planner died: its lease lapses
    region.load(PREFILL_HEAVY)
    assert store.leases.acquire("planner", other.holder, ttl_s=10)
    assert not store.leases.acquire("planner", region.planner.holder, ttl_s=10)


def test_plan_is_pure_over_a_snapshot():
    def site(name, role, active=None, **cap):
        return {"name": name, "region": "r", "roles": ["prefill", "decode"], "state": "active", "alive": True,
                "models": [{"model": "m", "role": role}], "active_role": active, "active_role_since": None,
                "capacity": {"kv_blocks_total": 100, "kv_blocks_free": 100, "draining": False, **cap}}
    heavy = {"sites": [site("a", "prefill", inflight_prefill_tokens=50_000), site("b", "both"), site("c", "both"),
                       site("d", "decode")]}
    changes = plan(heavy, now=0.0, settings=SETTINGS)
    assert [(c.site, c.role) for c in changes] == [("b", "prefill")]  # one change per region per tick


def test_a_site_is_not_narrowed_when_only_sites_of_another_model_keep_the_role():
    """Region r: x and y each serve their own model. Prefill is backed up, but narrowing either to
    prefill would leave its model with no decode site in the region; once z serves x's model too, x
    (or z) may go."""
    def site(name, model, **cap):
        return {"name": name, "region": "r", "roles": ["prefill", "decode"], "state": "active", "alive": True,
                "models": [{"model": model, "role": "both"}], "active_role": None, "active_role_since": None,
                "capacity": {"kv_blocks_total": 100, "kv_blocks_free": 100, "draining": False,
                             "inflight_prefill_tokens": 30_000, **cap}}
    two_models = {"sites": [site("x", "llama"), site("y", "qwen")]}
    assert plan(two_models, now=0.0, settings=SETTINGS) == []
    with_z = {"sites": [site("x", "llama"), site("y", "qwen"), site("z", "llama")]}
    assert [(c.site, c.role) for c in plan(with_z, now=0.0, settings=SETTINGS)] in ([("x", "prefill")],
                                                                                      [("z", "prefill")])


def flex_in_snapshot(region) -> RouterSite:
    return parse_site(next(s for s in json.loads(region.snapshots.get().body)["sites"] if s["name"] == "flex"))


async def test_the_operator_narrowing_a_picked_sites_roles_wins_over_the_planner(region, store, admin):
    """flex was picked for prefill; the operator then allows it decode only. Kept, the pick would leave
    flex taking nothing (routers: not allowed prefill, picked out of decode) for as long as it lasted,
    since the planner never touches a site allowed one role."""
    region.run(PREFILL_HEAVY, 2)
    assert region.active_role("flex") == "prefill"

    site = await admin.set_roles("flex", ["decode"])
    assert site["roles"] == ["decode"] and site["active_role"] is None
    assert flex_in_snapshot(region).serves("m", "decode")
    status = store.telemetry.record_heartbeat(region.site_ids["flex"], capacity(1000, 900, 16))
    assert status.to_json()["active_role"] is None  # the agent takes decode work again
    dropped = next(e for e in store.audit.list(100).items if e.action == "site.active_role")
    assert (dropped.actor, dropped.detail["from"], dropped.detail["to"]) == ("admin:alice", "prefill", "both")
    assert "decode" in dropped.detail["reason"]

    assert region.run(PREFILL_HEAVY, 70) == []  # still prefill-heavy: the operator's word holds
    assert region.active_role("flex") is None

    await admin.set_roles("flex", ["prefill", "decode"])  # allowed both again: the planner's to move
    assert [(site, role) for _, site, role in region.run(PREFILL_HEAVY, 4)] == [("flex", "prefill")]


def test_an_agent_re_registering_one_role_drops_the_planners_pick(region, store):
    """flex's agent comes back configured for prefill only while the planner has it in the decode
    pool: its models now offer prefill alone, so the pick goes, and the planner cannot set it again."""
    region.run(DECODE_HEAVY, 2)
    assert region.active_role("flex") == "decode"

    store.sites.update("flex", {"models": [ModelServed("m", "prefill")]}, "site:flex", "site.register")
    assert region.active_role("flex") is None
    assert flex_in_snapshot(region).serves("m", "prefill")
    with pytest.raises(InvalidInput, match="offers only \\['prefill'\\]"):
        store.sites.set_active_role("flex", "decode", "planner", {"reason": "a planner with an old snapshot"})


@pytest.mark.parametrize("lose_decode_site", ["cordon", "drain", "die"])
def test_a_narrowed_site_takes_back_the_role_nobody_else_in_the_region_does(region, store, lose_decode_site):
    """flex went to the prefill pool because dec decoded for the region; dec then leaves. Holding flex
    to the dwell would leave a region-bound key with no decode site at all (every request refused),
    for as long as prefill stays heavy. It goes back to both at the next tick, and stays there."""
    region.run(PREFILL_HEAVY, 2)
    assert region.active_role("flex") == "prefill"
    if lose_decode_site == "cordon":
        store.sites.cordon("dec", "ops")
    elif lose_decode_site == "drain":
        store.sites.drain("dec", 30.0, "ops")
    without_dec = {name: figures for name, figures in PREFILL_HEAVY.items() if name != "dec"}
    if lose_decode_site == "die":
        region.clock.advance(10.0)  # dec's last heartbeat ages past its liveness window; the others beat on

    changes = region.run(without_dec if lose_decode_site == "die" else PREFILL_HEAVY, 30)
    assert [(site, role) for _, site, role in changes] == [("flex", "both")]
    assert region.active_role("flex") is None
    assert flex_in_snapshot(region).serves("m", "decode")
    entry = next(e for e in store.audit.list(100).items if e.action == "site.active_role")
    assert entry.actor == "planner" and "no other usable site in eu-west does decode for m" in entry.detail["reason"]


def test_a_dry_run_beside_the_real_planner_never_holds_it_back(region, store, clock, caplog):
    """An operator previews with `--planner-dry-run` on one replica while another runs the planner:
    the preview logs, and the real planner still acts (it did not wait on the preview's lease)."""
    dry_run = PlannerSettings(min_dwell_s=60.0, settle_s=5.0, dry_run=True)
    preview = Planner(store, region.planner.read_snapshot, dry_run, clock=clock)
    with caplog.at_level("INFO", logger="registry.planner"):
        region.load(PREFILL_HEAVY)
        assert [(c.site, c.role) for c in preview.tick()] == [("flex", "prefill")]  # ticked first
        changes = region.run(PREFILL_HEAVY, 4)
    assert "would set flex (eu-west) to prefill" in caplog.text
    assert [(site, role) for _, site, role in changes] == [("flex", "prefill")]
    assert region.active_role("flex") == "prefill"


@pytest.mark.parametrize(("settings", "message"), [
    ({"min_dwell_s": 0.0}, "min_dwell_s: must be > 0"),
    ({"min_dwell_s": -30.0}, "min_dwell_s: must be > 0"),
    ({"min_dwell_s": 1.0, "interval_s": 2.0}, "min_dwell_s (1.0) must be at least interval_s (2.0)"),
    ({"low": 1.5, "high": 1.0}, "low (1.5) must be below high (1.0)"),
    ({"target_kv_used": 90.0}, "target_kv_used: the fraction of the KV pool in use"),
    ({"settle_s": float("nan")}, "settle_s: must be a finite number"),
])
def test_planner_settings_that_make_no_sense_are_refused_saying_why(tmp_path, settings, message):
    path = tmp_path / "planner.toml"
    path.write_text("[planner]\n" + "".join(f"{k} = {'nan' if v != v else v}\n" for k, v in settings.items()))
    with pytest.raises(ConfigError, match=re.escape(message)):
        typed_config.load(PlannerSettings, path, table="planner")
