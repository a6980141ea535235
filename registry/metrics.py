"""Prometheus metrics of one registry app, on its own CollectorRegistry (tests run several apps in a process).

Served as `GET /metrics` on the registry's own port, which is an internal API where every call
carries a token: a scrape needs the metrics token (`--metrics-token`, so Prometheus never holds the
admin token) or the admin token. With `serve --workers N` every worker records into shared files
(prometheus-client's multiprocess mode, `multiprocess_dir`), and a scrape, whichever worker answers
it, sums every worker's counters and histograms.

What is counted where: heartbeats and their latency in `routes_agent.store_heartbeat` (both the
fast path and FastAPI's route), rows per group commit in the heartbeat batcher, snapshot work in
`SnapshotCache`, database failures where they become 503s (`http_errors`), admin API calls by
action and status (`routes_admin.AdminRoute`), router placement reports in `routes_router`. Sites
by state and liveness are read from the snapshot cache at scrape time.
"""

from __future__ import annotations

import os
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.exc import OperationalError

STATES = ("active", "cordoned", "draining")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
SNAPSHOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ROWS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's own switch, read when it is imported


def multiprocess_dir() -> str | None:
    """The directory `serve --workers N` shares between its workers' metrics (None: one process)."""
    return os.environ.get(MULTIPROCESS_ENV) or None


class RegistryMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.heartbeats = Counter("edgefire_registry_heartbeats", "Heartbeats answered, by outcome: stored, "
                                  "rejected (token or body refused) or failed (the database)", ["outcome"], registry=r)
        self.heartbeat_latency = Histogram("edgefire_registry_heartbeat_latency_seconds", "From a heartbeat's "
                                           "arrival to its answer, its group commit included",
                                           buckets=LATENCY_BUCKETS, registry=r)
        self.heartbeat_commit_rows = Histogram("edgefire_registry_heartbeat_commit_rows", "Heartbeats stored per "
                                               "group commit", buckets=ROWS_BUCKETS, registry=r)
        self.snapshot_builds = Counter("edgefire_registry_snapshot_builds", "Snapshot work by step: read (rows from "
                                       "the database), apply (this process's heartbeat commits), render (the JSON "
                                       "body), render_deflate (the body compressed, for routers that accept it), "
                                       "render_packed and render_packed_deflate (the same with packed prefix hashes, "
                                       "for routers that ask)", ["step"], registry=r)
        self.snapshot_build_seconds = Histogram("edgefire_registry_snapshot_build_seconds", "Time per snapshot "
                                                "step", ["step"], buckets=SNAPSHOT_BUCKETS, registry=r)
        self.snapshot_requests = Counter("edgefire_registry_snapshot_requests", "Router snapshot requests, by "
                                         "answer (200 with a body, 304 unchanged)", ["status"], registry=r)
        self.db_errors = Counter("edgefire_registry_db_errors", "Requests answered 503 because the database "
                                 "failed", registry=r)
        self.admin_actions = Counter("edgefire_registry_admin_actions", "Admin API calls, by action and HTTP "
                                     "status", ["action", "status"], registry=r)
        self.placement_reports = Counter("edgefire_registry_placement_reports", "Placement reports received "
                                         "from routers", registry=r)
        self.fleet_reports = Counter("edgefire_registry_fleet_reports", "Routers' usage and rate-limit reports, "
                                     "by outcome: applied, or resent (applied before; answered again)", ["outcome"],
                                     registry=r)
        for outcome in ("stored", "rejected", "failed"):
            self.heartbeats.labels(outcome)
        self._sites: _SitesCollector | None = None

    def follow(self, snapshots) -> None:
        """Sites by state and liveness come from `snapshots` (registry.snapshot_cache.SnapshotCache)."""
        self._sites = _SitesCollector(snapshots)
        self.registry.register(self._sites)

    def render(self) -> bytes:
        """The exposition text: this process's metrics, or every worker's under `serve --workers N`.
        May read the database (the site gauges): call it off the event loop."""
        directory = multiprocess_dir()
        if directory is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, directory)
        if self._sites is not None:
            merged.register(self._sites)
        return generate_latest(merged)


class _SitesCollector(Collector):
    """`edgefire_registry_sites{state, alive}`: every combination, 0 included, from the current snapshot."""

    def __init__(self, snapshots) -> None:
        self._snapshots = snapshots

    def describe(self):
        return [GaugeMetricFamily("edgefire_registry_sites", "Sites by state and liveness", labels=["state", "alive"])]

    def collect(self):
        family = GaugeMetricFamily("edgefire_registry_sites", "Sites by state and liveness",
                                   labels=["state", "alive"])
        try:
            counts: Tally = self._snapshots.site_counts()
        except OperationalError:
            return  # the database is away: no site figures rather than wrong ones
        for state in sorted({*STATES, *(state for state, _ in counts)}):
            for alive in (True, False):
                family.add_metric([state, "true" if alive else "false"], counts.get((state, alive), 0))
        yield family
