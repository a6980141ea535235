"""A planner that stalls after taking its lease (a long pause between planning and writing) must not
apply a role change once it no longer holds the lease: the lease is checked inside the change's own
transaction, nothing is written without it, and the planner logs that it lost the lease. On SQLite
and PostgreSQL."""

from __future__ import annotations

import pytest

from registry.leases import LeaseClaim, LeaseLost
from registry.planner import LEASE_NAME, Planner, PlannerSettings
from registry.records import ModelServed, SiteSpec
from registry.snapshot_cache import SnapshotCache
from registry.telemetry import HeartbeatWrite

from .conftest import capacity

SETTINGS = PlannerSettings(min_dwell_s=60.0, settle_s=5.0)
LEASE_TTL_S = 3 * SETTINGS.interval_s  # what Planner.tick takes
PREFILL_HEAVY = {"pre": dict(inflight_prefill_tokens=40_000, prefill_tokens_per_s=4000.0),
                 "dec": dict(num_running=2, decode_tokens_per_s=500.0),
                 "flex": dict(inflight_prefill_tokens=8000, prefill_tokens_per_s=4000.0)}


class Region:
    """pre (prefill only), dec (decode only) and flex (both) in one region, prefill-heavy: a planner
    that ticks narrows flex to prefill."""

    def __init__(self, store, clock) -> None:
        self.store, self.clock = store, clock
        self.site_ids = {}
        for name, role in (("pre", "prefill"), ("dec", "decode"), ("flex", "both")):
            spec = SiteSpec("eu-west", "PT", 38.7, -9.1, f"{name}:1", ["prefill", "decode"], [ModelServed("m", role)])
            store.sites.create(name, spec, "ops")
            self.site_ids[name] = store.access.site_for_token(store.access.issue_site_token(name, "ops")).site_id
        self.snapshots = SnapshotCache(store.engine, clock=clock, max_body_age_s=0.0)

    def heartbeat(self) -> None:
        self.store.telemetry.record_heartbeats([HeartbeatWrite(self.site_ids[name], capacity(1000, 900, 16, **figures),
                                                               self.clock.now) for name, figures in PREFILL_HEAVY.items()])

    def planner(self, stall=None) -> Planner:
        """A planner reading the snapshot; `stall` runs after it has read it, before it writes anything."""
        def read_snapshot() -> bytes:
            body = self.snapshots.get().body
            if stall is not None:
                stall()
            return body
        return Planner(self.store, read_snapshot, SETTINGS, clock=self.clock)

    def role_changes(self) -> list:
        return [(e.actor, e.target, e.detail["to"]) for e in self.store.audit.list(100).items
                if e.action == "site.active_role"]


@pytest.fixture
def region(store, clock):
    region = Region(store, clock)
    region.heartbeat()
    return region


def test_a_stalled_planner_whose_lease_was_taken_writes_nothing(region, store, clock, caplog):
    other = region.planner()

    def stall_until_the_other_planner_takes_over():
        clock.advance(LEASE_TTL_S + 1)
        assert store.leases.acquire(LEASE_NAME, other.holder, LEASE_TTL_S)

    stalled = region.planner(stall=stall_until_the_other_planner_takes_over)
    version = store.version()
    with caplog.at_level("WARNING", logger="registry.planner"):
        assert stalled.tick() == []  # it planned flex -> prefill from what it read, and lost the lease meanwhile
    assert store.sites.get("flex").active_role is None
    assert region.role_changes() == [] and store.version() == version and stalled.num_changes == 0
    assert "lost the planner lease before setting flex to prefill" in caplog.text
    assert f"{other.holder} holds it" in caplog.text

    region.heartbeat()
    assert [(c.site, c.role) for c in other.tick()] == [("flex", "prefill")]  # the holder plans from here
    assert region.role_changes() == [("planner", "flex", "prefill")]


def test_a_planner_whose_lease_ran_out_while_it_stalled_writes_nothing_until_it_renews(region, store, clock, caplog):
    stalled = region.planner(stall=lambda: clock.advance(LEASE_TTL_S + 1))
    with caplog.at_level("WARNING", logger="registry.planner"):
        assert stalled.tick() == []
    assert "lost the planner lease" in caplog.text and "it expired" in caplog.text
    assert store.sites.get("flex").active_role is None and region.role_changes() == []

    planner = region.planner()
    planner.holder = stalled.holder  # the same planner, no longer stalling: it renews the lease and acts
    region.heartbeat()
    assert [(c.site, c.role) for c in planner.tick()] == [("flex", "prefill")]
    assert store.sites.get("flex").active_role == "prefill"


def test_a_role_change_under_a_lease_is_written_only_for_its_holder(region, store, clock):
    assert store.leases.acquire(LEASE_NAME, "planner-a", LEASE_TTL_S)
    version = store.version()
    for claim in (LeaseClaim(LEASE_NAME, "planner-b"), LeaseClaim("another-lease", "planner-a")):
        with pytest.raises(LeaseLost) as lost:
            store.sites.set_active_role("flex", "prefill", "planner", {"reason": "test"}, lease=claim)
        assert lost.value.code == "lease_lost"
    assert store.version() == version and region.role_changes() == []
    assert store.sites.get("flex").active_role is None

    site = store.sites.set_active_role("flex", "prefill", "planner", {"reason": "test"},
                                       lease=LeaseClaim(LEASE_NAME, "planner-a"))
    assert site.active_role == "prefill" and region.role_changes() == [("planner", "flex", "prefill")]
    # The holder's change did not renew or release the lease: the other planner is still shut out.
    assert not store.leases.acquire(LEASE_NAME, "planner-b", LEASE_TTL_S)
