"""What agents report: capacity heartbeats (one upsert per site) and measured site-to-site links.

`record_heartbeats` takes a whole batch in one transaction: the service's group-commit loop
hands it every heartbeat that arrived while the previous commit ran, which is what lets one
process keep up with thousands of sites.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import TypeAdapter
from sqlalchemy import Connection, Engine, case, delete, select, text

from registry import validate
from registry.db import writer
from registry.errors import InvalidInput, NotFound
from registry.records import LinkMeasurement, SiteStatus
from registry.sql import SITES, bump_version, upsert
from registry.tables import CapacityRow, LinkRow
from registry.wire import CapacityReport, ModelCapacity

CAPACITY = CapacityRow.__table__
LINKS = LinkRow.__table__
MODELS_SOURCE = "models_reported_at"  # which heartbeat `models` came from (tables.CapacityRow)
CAPACITY_FIELDS = [c.name for c in CAPACITY.columns if c.name not in ("site_id", MODELS_SOURCE)]  # what readers see
_WRITTEN_FIELDS = [*CAPACITY_FIELDS, MODELS_SOURCE]
# `models` as readers take it: only where the row's last capacity write stored it too. A registry older than
# `models` moves reported_at and leaves `models` (and its source) behind, figures older than the site's own;
# NULL instead makes the site's figures stand for every model, which they do (a site reports its pools' sums).
FRESH_MODELS = case((CAPACITY.c[MODELS_SOURCE] == CAPACITY.c.reported_at, CAPACITY.c.models)).label("models")
# The capacity columns as readers select them: site_id, then CAPACITY_FIELDS.
CAPACITY_COLUMNS = [CAPACITY.c.site_id, *(FRESH_MODELS if n == "models" else CAPACITY.c[n] for n in CAPACITY_FIELDS)]
_MODELS_JSON = TypeAdapter(dict[str, ModelCapacity])
_PG_ARRAY_TYPES = {"site_id": "integer", "block_size": "integer", "num_running": "integer", "num_waiting": "integer",
                   "prefix_cache_summary": "text", "draining": "boolean", "kv_blocks_total": "bigint",
                   "kv_blocks_free": "bigint", "inflight_prefill_tokens": "bigint", "inflight_decode_tokens": "bigint",
                   "num_gpus": "integer", "tensor_parallel_size": "integer", "pipeline_parallel_size": "integer",
                   "expert_parallel_size": "integer"}
_PG_COLUMNS = ["site_id", *_WRITTEN_FIELDS]
JSON_TEXT_COLUMNS = ("prefix_cache_summary", "models")  # JSON text, NULL where the heartbeat had none
_PG_ARRAY_COLUMNS = [c for c in _PG_COLUMNS if c not in JSON_TEXT_COLUMNS]
# One array parameter per column; the JSON text columns (many quotes, which psycopg would escape one
# regex match at a time in a text[] array) travel as one JSON array of strings each instead.
PG_UPSERT_CAPACITY = text(
    f"INSERT INTO capacity ({', '.join(_PG_COLUMNS)}) "
    f"SELECT {', '.join(f'{c}.v' if c in JSON_TEXT_COLUMNS else f'u.{c}' for c in _PG_COLUMNS)} FROM unnest("
    + ", ".join(f"CAST(:{c} AS {_PG_ARRAY_TYPES.get(c, 'double precision')}[])" for c in _PG_ARRAY_COLUMNS)
    + f") WITH ORDINALITY AS u({', '.join(_PG_ARRAY_COLUMNS)}, ord)"
    + "".join(f" JOIN json_array_elements_text(CAST(:{c} AS json)) WITH ORDINALITY AS {c}(v, ord) USING (ord)"
              for c in JSON_TEXT_COLUMNS)
    + " ON CONFLICT (site_id) DO UPDATE SET "
    + ", ".join(f"{c} = EXCLUDED.{c}" for c in _WRITTEN_FIELDS)
)


@dataclass(slots=True)
class HeartbeatWrite:
    site_id: int
    capacity: CapacityReport  # validated when it was built: the contract's bounds fit the columns
    reported_at: float  # the registry's clock, not the agent's: liveness must not depend on clock skew


class TelemetryStore:
    def __init__(self, engine: Engine, clock: Callable[[], float] = time.time) -> None:
        self._write = writer(engine)
        self._clock = clock
        # Called after each capacity commit with (new registry version, rows written): lets this
        # process's snapshot cache follow its own heartbeats without re-reading the database.
        self.capacity_listeners: list[Callable[[int, list[dict]], None]] = []
        insert = upsert(engine, CAPACITY)
        self._upsert_capacity = insert.on_conflict_do_update(
            index_elements=[CAPACITY.c.site_id], set_={name: insert.excluded[name] for name in _WRITTEN_FIELDS},
        )
        insert = upsert(engine, LINKS)
        self._upsert_link = insert.on_conflict_do_update(
            index_elements=[LINKS.c.src_site_id, LINKS.c.dst_site_id],
            set_={name: insert.excluded[name] for name in ("rtt_ms", "bandwidth_mbps", "measured_at")},
        )

    def now(self) -> float:
        return self._clock()

    def record_heartbeat(self, site_id: int, capacity: CapacityReport) -> SiteStatus:
        statuses = self.record_heartbeats([HeartbeatWrite(site_id, capacity, self._clock())])
        if site_id not in statuses:
            raise NotFound("this site no longer exists", "site_not_found")
        return statuses[site_id]

    def record_heartbeats(self, writes: list[HeartbeatWrite]) -> dict[int, SiteStatus]:
        """Stores the latest heartbeat per site; returns the status of every site that still exists.

        Heartbeats of deleted sites are dropped (absent from the result), not an error for the batch.
        """
        return self.write_capacity_rows([capacity_row(write) for write in writes])

    def write_capacity_rows(self, rows: list[dict]) -> dict[int, SiteStatus]:
        """record_heartbeats for rows already checked by capacity_row (the group-commit path)."""
        latest = {row["site_id"]: row for row in rows}  # the last heartbeat of a site wins
        site_ids = sorted(latest)  # one lock order for every batch
        with self._write.begin() as conn:
            query = (select(SITES.c.id, SITES.c.state, SITES.c.drain_deadline, SITES.c.active_role)
                     .where(SITES.c.id.in_(site_ids)))
            statuses = {r.id: SiteStatus(r.state, r.drain_deadline, r.active_role) for r in conn.execute(query)}
            rows = [latest[i] for i in site_ids if i in statuses]
            if rows:
                self._store_capacity(conn, rows)
                version = bump_version(conn)
        if rows:
            for listener in self.capacity_listeners:
                listener(version, rows)
        return statuses

    def _store_capacity(self, conn: Connection, rows: list[dict]) -> None:
        if conn.dialect.name != "postgresql":
            conn.execute(self._upsert_capacity, rows)  # SQLite runs executemany in-process: already cheap
            return
        # Heartbeats are resent every interval, so losing the last few hundred milliseconds of them
        # in a crash is harmless; not waiting for the WAL flush makes each commit several times cheaper.
        conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
        # One statement with one array per column instead of a round trip per row.
        columns = {name: [row[name] for row in rows] for name in _PG_ARRAY_COLUMNS}
        for name in JSON_TEXT_COLUMNS:
            columns[name] = json.dumps([row[name] for row in rows])
        conn.execute(PG_UPSERT_CAPACITY, columns)

    def clear_capacity(self, site_id: int) -> None:
        """The agent is leaving: with no capacity row the snapshot reports the site down at once."""
        with self._write.begin() as conn:
            conn.execute(delete(CAPACITY).where(CAPACITY.c.site_id == site_id))
            bump_version(conn)

    def record_links(self, site_id: int, links: list[LinkMeasurement]) -> int:
        """Stores this site's measurements to its peers; all or nothing. Returns how many were stored."""
        for measurement in links:
            validate.link(measurement)
        if not links:
            return 0
        now = self._clock()
        with self._write.begin() as conn:
            # The reporting site may have been deleted since its token was checked (another replica's token
            # cache); FOR KEY SHARE (PostgreSQL; what a foreign key check takes) keeps it until the commit.
            if conn.execute(select(SITES.c.id).where(SITES.c.id == site_id)
                            .with_for_update(read=True, key_share=True)).first() is None:
                raise NotFound(f"site id {site_id} no longer exists", "site_not_found")
            peers = {r.name: r.id for r in conn.execute(
                select(SITES.c.name, SITES.c.id).where(SITES.c.name.in_({m.peer for m in links}))
            )}
            unknown = sorted({m.peer for m in links} - set(peers))
            if unknown:
                raise InvalidInput(f"unknown peer sites {unknown}", "unknown_peer")
            if site_id in {peers[m.peer] for m in links}:
                raise InvalidInput("a site cannot measure a link to itself", "invalid_peer")
            rows = {peers[m.peer]: {
                "src_site_id": site_id, "dst_site_id": peers[m.peer], "rtt_ms": m.rtt_ms,
                "bandwidth_mbps": m.bandwidth_mbps, "measured_at": now,
            } for m in links}
            conn.execute(self._upsert_link, [rows[k] for k in sorted(rows)])
            bump_version(conn)
        return len(rows)


def capacity_row(write: HeartbeatWrite) -> dict:
    """The row to upsert for a heartbeat; the prefix-cache summary and the models' own figures are stored
    as their JSON text, the latter marked as this heartbeat's (CAPACITY_COLUMNS)."""
    cap = write.capacity
    row = cap.model_dump(exclude=set(JSON_TEXT_COLUMNS))
    summary = cap.prefix_cache_summary
    row.update(site_id=write.site_id, reported_at=write.reported_at, models_reported_at=write.reported_at,
               prefix_cache_summary=None if summary is None else summary.model_dump_json(),
               models=None if cap.models is None else _MODELS_JSON.dump_json(cap.models).decode())
    return row
