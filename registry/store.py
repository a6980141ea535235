"""The registry store: one object over the SQL database that the service (or a test, or the
one-machine launcher) drives with plain calls. It knows nothing of HTTP.

    store = RegistryStore.open("sqlite:///var/edgefire/registry.db")
    store.sites.create("fra-1", SiteSpec(region="eu-west", country="DE", lat=50.1, lon=8.7), actor="ops")
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlalchemy import Engine

from registry.access import AccessStore
from registry.audit import AuditLog
from registry.db import make_engine
from registry.fleet import FleetStore
from registry.leases import LeaseStore
from registry.placements import PlacementStore
from registry.sites import SiteStore
from registry.snapshot import SnapshotData, read_db_version, read_snapshot
from registry.telemetry import TelemetryStore


class RegistryStore:
    def __init__(self, engine: Engine, clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.sites = SiteStore(engine, clock)
        self.access = AccessStore(engine, clock)
        self.telemetry = TelemetryStore(engine, clock)
        self.audit = AuditLog(engine)
        self.leases = LeaseStore(engine, clock)
        self.placements = PlacementStore(engine, clock)
        self.fleet = FleetStore(engine, clock)

    @classmethod
    def open(cls, db_url: str, clock: Callable[[], float] = time.time) -> RegistryStore:
        """Opens an already-migrated database (`edgefire registry migrate`)."""
        return cls(make_engine(db_url), clock)

    def version(self) -> int:
        return read_db_version(self.engine)

    def snapshot(self) -> SnapshotData:
        return read_snapshot(self.engine)

    def close(self) -> None:
        self.engine.dispose()
