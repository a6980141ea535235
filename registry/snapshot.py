"""The routers' snapshot: every site with its latest capacity and liveness, plus measured links.

Reading (`SnapshotReader.read`) and rendering (`SnapshotData.render`) are split because liveness
moves with the clock while the rows do not: one read serves every render until the registry
version changes. Each site's JSON is encoded once and kept, keyed by the rows it came from, so a
re-read after a change re-encodes only the sites whose rows changed, and a heartbeat commit of this
process updates the data in place (`apply_capacity`) without reading anything. A render is string
joins of those fragments plus each site's age.

Compressed (`render_deflated`, for a router whose request accepts `deflate`). Heartbeats move the
registry version with every group commit, so routers rarely hold the current ETag and each poll
takes the whole body: 3.7 MB for 300 sites of which 60 report 2,000-4,000 prefix-cache hashes.
Compressing that body per render costs 31 ms at zlib level 1 (a render costs 0.15 ms), and under
heartbeat load nearly every poll renders. So each fragment is compressed once, on its own, when it
is first served (`DeflatedFragments`, keyed by the fragment object, so a re-read keeps what did not
change), and a render splices those raw deflate blocks with the few bytes that move with the clock
(liveness, ages, separators) as stored blocks. That is valid deflate because every fragment starts
from an empty history and ends byte-aligned (a sync flush); the zlib trailer's Adler-32 is combined
from the fragments' own. Measured on that fleet: 2.14 MB (58%; the whole body at level 1: 54%, the
hex hashes' information is 42%), 0.74 ms per render, and a fragment's compression is paid once per
capacity row (a 3,000-hash tail: 0.5 ms).

Packed hashes (`PackedTails`, for a router whose request asks for registry.wire's
PACKED_SNAPSHOT_MEDIA_TYPE). The same document with each prefix-cache summary's `hashes` list written
as `packed_hashes` (base64 of the 8-byte words, registry.wire.pack_cache_hashes): 11 bytes per hash
instead of 19, and no hex string for the router to parse. A site's capacity is written in that shape
once, when a packed render first needs it, and kept while its row does not change, like the deflated
fragments; compressed, it goes through its own `DeflatedFragments`. Measured over HTTP on a like fleet
(300 sites, 60 with 2,000-4,000 hashes, two links each; load average 6-8): JSON 3.89 MB, deflated 2.21 MB;
packed 2.33 MB, packed and deflated 1.70 MB (deflated base64 is within 3% of the raw 8-byte words, so a
binary framing would save little for a router that accepts deflate). A packed render costs what a JSON
one does (0.8-1.1 vs 1.5 ms plain, 2.3 vs 2.3-3.1 ms deflated, same runs). Each representation has its
own ETag (registry/snapshot_cache.py).

Back from an outage. Agents back off while the registry is away, so when it returns every
heartbeat is stale at once; declaring every site dead then would stop every router. A site that was
alive when the registry went away (its heartbeat within one TTL of the newest one the registry had
then) therefore counts as seen at the return (`RegistryReturn`): one liveness window to heartbeat
again, and its `heartbeat_age_s` counts from the return. The capacity's `reported_at` stays the
real report time. A process that starts while other replicas kept serving grants the same window,
which at worst keeps a site that died just then listed for one extra TTL.

Wire shape:
  {"version": str, "generated_at": float, "sites": [{"name", "region", "country", "lat", "lon",
   "grpc_address", "state", "roles", "active_role", "active_role_since",
   "models": [{"model", "role", "kv_bytes_per_token"?, "kv_format"?}],
   "role_offer": {"roles": [...], "by_model": {model: [...]}, "flexible": bool}, "alive": bool,
   "heartbeat_age_s": float | null, "capacity": {...capacity fields, "reported_at", "models"?} | null}],
   "links": [{"src", "dst", "rtt_ms", "bandwidth_mbps", "measured_at"}]}
A capacity's and each of its models' "prefix_cache_summary" is {"block_size", "hashes": [hex, ...],
"num_held"?}, or in the packed format {"block_size", "packed_hashes": base64, "num_held"?}: the hashes most
recently used first, the first `num_held` of them held by running sequences or KV leases and the rest
evictable (registry.wire: "Held and evictable cached blocks"); without `num_held` (an agent older than the
field) a reader takes them all as held. Readers older than the field ignore it.
`role_offer` is registry.wire.RoleOffer: the roles the site takes work in now, per model and in all,
and whether the pool planner may move it; every reader of a site's role reads it from here.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections import Counter
from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, select
from sqlalchemy.orm import aliased

from registry.records import liveness_ttl_s
from registry.sql import SITE_MODELS, SITES, read_version
from registry.tables import CapacityRow, LinkRow, SiteRow
from registry.telemetry import CAPACITY_COLUMNS, CAPACITY_FIELDS, JSON_TEXT_COLUMNS
from registry.wire import pack_cache_hashes, role_offer

CAPACITY = CapacityRow.__table__
LINKS = LinkRow.__table__
_SITE_COLUMNS = [SITES.c[n] for n in ("id", "name", "region", "country", "lat", "lon", "grpc_address", "state",
                                      "roles", "heartbeat_interval_s", "active_role", "active_role_since")]
_CAPACITY_COLUMNS = CAPACITY_COLUMNS  # `models` only where it is as fresh as the rest (registry.telemetry)
_PLAIN_CAPACITY_FIELDS = [n for n in CAPACITY_FIELDS if n not in JSON_TEXT_COLUMNS]
_REPORTED_AT = 1 + CAPACITY_FIELDS.index("reported_at")  # in a capacity row: site_id, then CAPACITY_FIELDS
_dumps = json.JSONEncoder(separators=(",", ":")).encode


_ALIVE = b',"alive":true,"heartbeat_age_s":'
_DEAD = b',"alive":false,"heartbeat_age_s":'
_NEVER_REPORTED = b',"alive":false,"heartbeat_age_s":null,"capacity":null}'
_ZLIB_HEADER = b"\x78\x01"  # deflate, 32 KiB window, fastest level (RFC 1950)
_FINAL_EMPTY_BLOCK = b"\x01\x00\x00\xff\xff"  # a last stored block of no bytes: ends the deflate data
_MAX_STORED = 0xFFFF  # bytes in one stored block
_ADLER_BASE = 65521


@dataclass(slots=True, frozen=True)
class RegistryReturn:
    """The registry (re)started at `at`; the newest heartbeat it held then is when it went away."""

    at: float
    went_away_at: float

    def seen_at(self, reported_at: float, ttl_s: float) -> float:
        alive_when_it_went_away = reported_at + ttl_s >= self.went_away_at
        return max(reported_at, self.at) if alive_when_it_went_away else reported_at


@dataclass(slots=True)
class SnapshotSite:
    head: bytes  # the site's JSON object up to its live fields (no closing brace)
    tail: bytes  # ',"capacity":<capacity JSON>}', or empty when the site has not reported
    seen_at: float | None  # the last heartbeat, or the registry's return for a site alive when it went away
    ttl_s: float
    state: str = "active"  # active | cordoned | draining (also in `head`; kept apart for the metrics)
    capacity: dict | None = None  # the capacity row `tail` was written from (column name -> value)


@dataclass(slots=True)
class SnapshotData:
    db_version: int
    sites: list[SnapshotSite]  # by site name
    links: str  # JSON text of the links array
    deadlines: list[float]  # sorted seen_at + ttl of every site that has reported
    by_id: dict[int, SnapshotSite]

    def version_at(self, now: float) -> str:
        """Changes with any row change and whenever a site's heartbeat expires."""
        return f"{self.db_version}.{bisect_right(self.deadlines, now)}"

    def render(self, now: float, packed: PackedTails | None = None) -> bytes:
        """The snapshot's JSON at `now`; with `packed`, in the packed format (its capacities from there)."""
        parts = [self._opening(now)]
        append = parts.append
        for site in self.sites:  # the one loop over every site per render: keep it to byte appends
            append(site.head)
            if site.seen_at is None:
                append(_NEVER_REPORTED)
            else:
                age = now - site.seen_at
                if age < 0.0:
                    age = 0.0
                append(_ALIVE if age <= site.ttl_s else _DEAD)
                append(b"%.3f" % age)
                append(site.tail if packed is None else packed.get(site))
            append(b",")
        if self.sites:
            parts.pop()  # no comma after the last site
        parts += [b'],"links":', self.links.encode(), b"}"]
        if packed is not None:
            packed.end_render()
        return b"".join(parts)

    def render_deflated(self, now: float, fragments: DeflatedFragments, packed: PackedTails | None = None) -> bytes:
        """`render(now, packed)` as a zlib stream (HTTP `Content-Encoding: deflate`), from compressed fragments
        (`fragments` of that one format: each render forgets the fragments it did not use)."""
        out = _DeflateStream(fragments)
        out.literal(self._opening(now))
        for i, site in enumerate(self.sites):  # the same bytes as render(), in the same order
            if i:
                out.literal(b",")
            out.fragment(site.head)
            if site.seen_at is None:
                out.literal(_NEVER_REPORTED)
                continue
            age = now - site.seen_at
            if age < 0.0:
                age = 0.0
            out.literal(_ALIVE if age <= site.ttl_s else _DEAD)
            out.literal(b"%.3f" % age)
            out.fragment(site.tail if packed is None else packed.get(site))
        out.literal(b'],"links":')
        out.fragment(self.links)
        out.literal(b"}")
        if packed is not None:
            packed.end_render()
        return out.finish()

    def _opening(self, now: float) -> bytes:
        head = _dumps({"version": self.version_at(now), "generated_at": now})[:-1]
        return f'{head},"sites":['.encode()

    def apply_capacity(self, db_version: int, rows: list[dict]) -> bool:
        """Moves the data to `db_version` = this version plus these capacity upserts (one heartbeat
        commit). False, with nothing changed, when a row's site is unknown here (read again)."""
        if any(row["site_id"] not in self.by_id for row in rows):
            return False
        for row in rows:
            site = self.by_id[row["site_id"]]
            if site.seen_at is not None:
                del self.deadlines[bisect_left(self.deadlines, site.seen_at + site.ttl_s)]
            site.tail, site.capacity = _tail(capacity_json(row)), row
            site.seen_at = row["reported_at"]
            insort(self.deadlines, site.seen_at + site.ttl_s)
        self.db_version = db_version
        return True

    def site_counts(self, now: float) -> Counter:
        """How many sites are in each (state, alive) pair at `now`."""
        return Counter((site.state, site.seen_at is not None and now - site.seen_at <= site.ttl_s)
                       for site in self.sites)

    def newest_heartbeat(self) -> float | None:
        return max((site.seen_at for site in self.sites if site.seen_at is not None), default=None)

    def apply_return(self, returned: RegistryReturn) -> None:
        """Gives every site alive when the registry went away one liveness window from its return."""
        for site in self.sites:
            if site.seen_at is not None:
                site.seen_at = returned.seen_at(site.seen_at, site.ttl_s)
        self.deadlines = sorted(site.seen_at + site.ttl_s for site in self.sites if site.seen_at is not None)


class SnapshotReader:
    """Reads SnapshotData, reusing the JSON of every site and capacity row unchanged since the last read."""

    def __init__(self) -> None:
        self._heads: dict[tuple, bytes] = {}
        self._tails: dict[tuple, tuple[bytes, dict]] = {}  # capacity row -> its JSON tail and the row by name
        self._links: tuple[list, str] = ([], "[]")
        self._sql: dict[str, str] = {}  # query name -> SQL text for this engine's dialect

    def read(self, engine: Engine) -> SnapshotData:
        with engine.connect() as conn:
            if engine.dialect.name == "postgresql":
                # Every query below must see the same moment, matching the version read first.
                conn = conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                return self._read(conn)

    def _read(self, conn: Connection) -> SnapshotData:
        db_version = read_version(conn)
        models: dict[int, list[tuple]] = {}
        for site_id, *served in self._fetch(conn, "models"):
            models.setdefault(site_id, []).append(tuple(served))
        capacities = {row[0]: row for row in self._fetch(conn, "capacity")}
        heads, tails = {}, {}
        sites, deadlines, by_id = [], [], {}
        for row in self._fetch(conn, "sites"):
            site_id, ttl_s = row[0], liveness_ttl_s(row[9])
            key = (*row, *models.get(site_id, ()))
            head = heads[key] = self._heads.get(key) or _head_json(row, models.get(site_id, []))
            cap = capacities.get(site_id)
            reported_at, tail, capacity = None, b"", None
            if cap is not None:
                tail, capacity = tails[cap] = self._tails.get(cap) or _capacity_tail(cap)
                reported_at = cap[_REPORTED_AT]
                deadlines.append(reported_at + ttl_s)
            site = by_id[site_id] = SnapshotSite(head, tail, reported_at, ttl_s, row[7], capacity)
            sites.append(site)
        self._heads, self._tails = heads, tails  # forget what no longer exists
        deadlines.sort()
        return SnapshotData(db_version, sites, self._links_json(conn), deadlines, by_id)

    def _links_json(self, conn: Connection) -> str:
        rows = self._fetch(conn, "links")
        if rows != self._links[0]:
            names = ("src", "dst", "rtt_ms", "bandwidth_mbps", "measured_at")
            self._links = (rows, _dumps([dict(zip(names, row)) for row in rows]))
        return self._links[1]


    def _fetch(self, conn: Connection, name: str) -> list[tuple]:
        """Plain tuples from the driver's cursor, inside this connection's transaction: at 10,000+
        rows SQLAlchemy's row objects cost more than the queries themselves."""
        if name not in self._sql:
            self._sql[name] = str(_QUERIES[name]().compile(dialect=conn.dialect))
        cursor = conn.connection.cursor()
        try:
            cursor.execute(self._sql[name])
            return cursor.fetchall()
        finally:
            cursor.close()


def _links_query():
    src, dst = aliased(SiteRow), aliased(SiteRow)
    return (
        select(src.name.label("src"), dst.name.label("dst"), LINKS.c.rtt_ms, LINKS.c.bandwidth_mbps, LINKS.c.measured_at)
        .join(src, src.id == LINKS.c.src_site_id)
        .join(dst, dst.id == LINKS.c.dst_site_id)
        .order_by(src.name, dst.name)
    )


_QUERIES = {
    "models": lambda: select(SITE_MODELS.c.site_id, SITE_MODELS.c.model, SITE_MODELS.c.role,
                             SITE_MODELS.c.kv_bytes_per_token, SITE_MODELS.c.kv_format)
    .order_by(SITE_MODELS.c.site_id, SITE_MODELS.c.model),
    "capacity": lambda: select(*_CAPACITY_COLUMNS),
    "sites": lambda: select(*_SITE_COLUMNS).order_by(SITES.c.name),
    "links": _links_query,
}


def read_snapshot(engine: Engine) -> SnapshotData:
    return SnapshotReader().read(engine)


def read_db_version(engine: Engine) -> int:
    with engine.connect() as conn:
        return read_version(conn)


def capacity_json(cap: dict, packed: bool = False) -> str:
    """One capacity row (column name -> value) as the snapshot's JSON text; the stored summary and models'
    figures are spliced in, the latter only where the site reported them (a single-model site's capacity
    reads as it always did). `packed`: every summary in the packed format."""
    plain = {name: cap[name] for name in _PLAIN_CAPACITY_FIELDS}
    plain["draining"] = bool(plain["draining"])
    summary, models = cap["prefix_cache_summary"], cap["models"]
    if packed:
        summary = summary and _dumps(_packed_summary(json.loads(summary)))
        models = models and _dumps({name: {**own, "prefix_cache_summary": _packed_summary(own.get("prefix_cache_summary"))}
                                    for name, own in json.loads(models).items()})
    models = f',"models":{models}' if models is not None else ""
    return f'{_dumps(plain)[:-1]},"prefix_cache_summary":{summary or "null"}{models}}}'


def _packed_summary(summary: dict | None) -> dict | None:
    """A stored summary in the packed format: its other fields (`num_held`) as they are."""
    if summary is None:
        return None
    fields = {name: value for name, value in summary.items() if name != "hashes"}
    return {**fields, "packed_hashes": pack_cache_hashes(summary["hashes"])}


def _capacity_tail(cap: tuple) -> tuple[bytes, dict]:
    row = dict(zip(("site_id", *CAPACITY_FIELDS), cap))
    return _tail(capacity_json(row)), row


def _tail(capacity: str) -> bytes:
    return f',"capacity":{capacity}}}'.encode()


class PackedTails:
    """Each site's capacity in the packed format, written once per capacity row, kept while renders use it.

    Keyed by the site's JSON tail object, which stays the same object while its row does not change; the
    packed tail in turn stays one object, so a compressed packed render finds its deflated fragment by it."""

    def __init__(self) -> None:
        self._kept: dict[bytes, bytes] = {}
        self._used: dict[bytes, bytes] = {}

    def get(self, site: SnapshotSite) -> bytes:
        if not site.tail:
            return site.tail
        found = self._used.get(site.tail) or self._kept.get(site.tail)
        if found is None:
            found = _tail(capacity_json(site.capacity, packed=True))
        self._used[site.tail] = found
        return found

    def end_render(self) -> None:
        """Forgets the tails the render just finished did not use (rows that changed or went away)."""
        self._kept, self._used = self._used, {}


def _served_json(model: str, role: str, kv_bytes_per_token: int | None, kv_format: str | None) -> dict:
    served = {"model": model, "role": role}
    if kv_bytes_per_token is not None:
        served["kv_bytes_per_token"] = kv_bytes_per_token
    if kv_format is not None:
        served["kv_format"] = kv_format
    return served


def _head_json(row, models: list[tuple]) -> bytes:
    roles, active_role = json.loads(row[8]), row[10]
    # Computed here once per change of the site's rows (the head is kept until they change).
    offer = role_offer(roles, ((model, role) for model, role, *_ in models), active_role)
    return _dumps({
        "name": row[1], "region": row[2], "country": row[3], "lat": row[4], "lon": row[5],
        "grpc_address": row[6], "state": row[7], "roles": roles,
        "active_role": active_role, "active_role_since": row[11],
        "models": [_served_json(*served) for served in models], "role_offer": offer.to_json(),
    })[:-1].encode()


@dataclass(slots=True, frozen=True)
class DeflatedFragment:
    """One fragment compressed on its own: raw deflate blocks from an empty history, ending byte-aligned
    and not final, so they splice anywhere in a deflate stream; with the fragment's Adler-32 and length."""

    blocks: bytes
    adler: int
    size: int


class DeflatedFragments:
    """Each fragment (a site's head or tail, the links) compressed once, kept while renders use it.

    Keyed by the fragment object itself: the reader and `apply_capacity` keep one bytes object per
    unchanged row, whose hash Python computes once, so a lookup costs no pass over the bytes."""

    def __init__(self, level: int = 1) -> None:
        self._level = level
        self._kept: dict[bytes | str, DeflatedFragment] = {}
        self._used: dict[bytes | str, DeflatedFragment] = {}

    def get(self, fragment: bytes | str) -> DeflatedFragment:
        found = self._used.get(fragment) or self._kept.get(fragment)
        if found is None:
            found = self._deflate(fragment.encode() if isinstance(fragment, str) else fragment)
        self._used[fragment] = found
        return found

    def end_render(self) -> None:
        """Forgets the fragments the render just finished did not use (rows that changed or went away)."""
        self._kept, self._used = self._used, {}

    def _deflate(self, data: bytes) -> DeflatedFragment:
        compressor = zlib.compressobj(self._level, zlib.DEFLATED, -zlib.MAX_WBITS)
        return DeflatedFragment(compressor.compress(data) + compressor.flush(zlib.Z_SYNC_FLUSH),
                                zlib.adler32(data), len(data))


class _DeflateStream:
    """A zlib stream assembled from compressed fragments and literal bytes (sent as stored blocks)."""

    def __init__(self, fragments: DeflatedFragments) -> None:
        self._fragments = fragments
        self._parts = [_ZLIB_HEADER]
        self._literals: list[bytes] = []
        self._adler = 1  # Adler-32 of no bytes

    def literal(self, data: bytes) -> None:
        self._literals.append(data)

    def fragment(self, fragment: bytes | str) -> None:
        if not fragment:
            return
        self._flush_literals()
        deflated = self._fragments.get(fragment)
        self._parts.append(deflated.blocks)
        self._adler = adler32_combine(self._adler, deflated.adler, deflated.size)

    def finish(self) -> bytes:
        self._flush_literals()
        self._fragments.end_render()
        self._parts += [_FINAL_EMPTY_BLOCK, struct.pack(">I", self._adler)]
        return b"".join(self._parts)

    def _flush_literals(self) -> None:
        if not self._literals:
            return
        data = b"".join(self._literals)
        self._literals.clear()
        self._adler = zlib.adler32(data, self._adler)
        for start in range(0, len(data), _MAX_STORED):
            chunk = data[start:start + _MAX_STORED]
            # A stored block, not final: its 3 header bits pad to one zero byte (the stream is byte-aligned here).
            self._parts += [b"\x00", struct.pack("<HH", len(chunk), len(chunk) ^ 0xFFFF), chunk]


def adler32_combine(adler1: int, adler2: int, len2: int) -> int:
    """The Adler-32 of A + B from A's, B's and B's length (zlib's adler32_combine, which Python does not expose)."""
    rem = len2 % _ADLER_BASE
    low1, high1 = adler1 & 0xFFFF, adler1 >> 16
    low = (low1 + (adler2 & 0xFFFF) + _ADLER_BASE - 1) % _ADLER_BASE
    high = (rem * low1 + high1 + (adler2 >> 16) + _ADLER_BASE - rem) % _ADLER_BASE
    return low | (high << 16)
