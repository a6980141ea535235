"""The routers' snapshot: every site with its latest capacity and liveness, plus measured links.

Reading (`read_snapshot`) and rendering (`SnapshotData.render`) are split because liveness moves
with the clock while the rows do not: one read serves every render until the registry version
changes. Each site's JSON is pre-encoded at read time and the stored prefix-cache summary text is
spliced in verbatim, so a render is string joins rather than re-encoding 10,000 objects.

Wire shape:
  {"version": str, "generated_at": float, "sites": [{"name", "region", "country", "lat", "lon",
   "grpc_address", "state", "roles", "models": [{"model", "role"}], "alive": bool,
   "heartbeat_age_s": float | null, "capacity": {...capacity fields, "reported_at"} | null}],
   "links": [{"src", "dst", "rtt_ms", "bandwidth_mbps", "measured_at"}]}
"""

from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, select
from sqlalchemy.orm import aliased

from registry.records import TTL_HEARTBEATS
from registry.sql import SITE_MODELS, SITES, read_version
from registry.tables import CapacityRow, LinkRow, SiteRow
from registry.telemetry import CAPACITY_FIELDS

CAPACITY = CapacityRow.__table__
LINKS = LinkRow.__table__
_SITE_COLUMNS = [SITES.c[n] for n in ("id", "name", "region", "country", "lat", "lon", "grpc_address", "state",
                                      "roles", "heartbeat_interval_s")]
_PLAIN_CAPACITY_FIELDS = [n for n in CAPACITY_FIELDS if n != "prefix_cache_summary"]
_dumps = json.JSONEncoder(separators=(",", ":")).encode


@dataclass(slots=True)
class SnapshotSite:
    head: str  # the site's JSON object without its closing brace and without the live fields
    capacity: str  # JSON text of the capacity object, or "null"
    reported_at: float | None
    ttl_s: float


@dataclass(slots=True)
class SnapshotData:
    db_version: int
    sites: list[SnapshotSite]
    links: str  # JSON text of the links array
    deadlines: list[float]  # sorted reported_at + ttl of every site that has reported

    def version_at(self, now: float) -> str:
        """Changes with any row change and whenever a site's heartbeat expires."""
        return f"{self.db_version}.{bisect_right(self.deadlines, now)}"

    def render(self, now: float) -> bytes:
        parts = []
        for site in self.sites:
            if site.reported_at is None:
                parts.append(f'{site.head},"alive":false,"heartbeat_age_s":null,"capacity":null}}')
                continue
            age = max(0.0, now - site.reported_at)
            alive = "true" if age <= site.ttl_s else "false"
            parts.append(f'{site.head},"alive":{alive},"heartbeat_age_s":{age:.3f},"capacity":{site.capacity}}}')
        head = _dumps({"version": self.version_at(now), "generated_at": now})[:-1]
        return f'{head},"sites":[{",".join(parts)}],"links":{self.links}}}'.encode()


def read_snapshot(engine: Engine) -> SnapshotData:
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            # Every query below must see the same moment, matching the version read first.
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            return _read(conn)


def read_db_version(engine: Engine) -> int:
    with engine.connect() as conn:
        return read_version(conn)


def _read(conn: Connection) -> SnapshotData:
    db_version = read_version(conn)
    models: dict[int, list[dict]] = {}
    for row in conn.execute(select(SITE_MODELS).order_by(SITE_MODELS.c.site_id, SITE_MODELS.c.model)):
        models.setdefault(row.site_id, []).append({"model": row.model, "role": row.role})
    capacity = {row.site_id: row for row in conn.execute(select(CAPACITY))}
    sites, deadlines = [], []
    for row in conn.execute(select(*_SITE_COLUMNS).order_by(SITES.c.name)):
        ttl_s = TTL_HEARTBEATS * row.heartbeat_interval_s
        cap = capacity.get(row.id)
        head = _dumps({
            "name": row.name, "region": row.region, "country": row.country, "lat": row.lat, "lon": row.lon,
            "grpc_address": row.grpc_address, "state": row.state, "roles": json.loads(row.roles),
            "models": models.get(row.id, []),
        })[:-1]
        sites.append(SnapshotSite(head, _capacity_json(cap), cap.reported_at if cap else None, ttl_s))
        if cap is not None:
            deadlines.append(cap.reported_at + ttl_s)
    deadlines.sort()
    return SnapshotData(db_version, sites, _links_json(conn), deadlines)


def _capacity_json(cap) -> str:
    if cap is None:
        return "null"
    plain = {name: getattr(cap, name) for name in _PLAIN_CAPACITY_FIELDS}
    plain["draining"] = bool(plain["draining"])
    return f'{_dumps(plain)[:-1]},"prefix_cache_summary":{cap.prefix_cache_summary or "null"}}}'


def _links_json(conn: Connection) -> str:
    src, dst = aliased(SiteRow), aliased(SiteRow)
    query = (
        select(src.name.label("src"), dst.name.label("dst"), LINKS.c.rtt_ms, LINKS.c.bandwidth_mbps, LINKS.c.measured_at)
        .join(src, src.id == LINKS.c.src_site_id)
        .join(dst, dst.id == LINKS.c.dst_site_id)
        .order_by(src.name, dst.name)
    )
    return _dumps([dict(row._mapping) for row in conn.execute(query)])
