"""Serving the snapshot cheaply: the rows are re-read only when the registry version moves,
and then only re-encoded where they changed; a version moved by this process's own heartbeat
commits is reached by applying those commits instead of reading at all (any other change, on this
replica or another, is read from the database: the version counter there is the reference). The
body is re-rendered at most every `max_body_age_s` (or when liveness flips), and a router whose
ETag is current gets a 304 without any rendering. A router that accepts `deflate` gets the body as a
zlib stream spliced from fragments compressed once each (registry/snapshot.py), cached the same way;
one that asks for the packed format gets its hashes packed (`PackedTails`), either way.

Four representations of one version, then: JSON or packed, each plain or deflated. Each has its own
strong ETag, the version with a suffix naming the format and coding (`"12.3"`, `"12.3-deflate"`,
`"12.3-packed"`, `"12.3-packed-deflate"`): with one ETag for all, a cache revalidating a deflated body
could be told it is current for a client that reads only plain JSON. If-None-Match is compared with
the ETag of the representation the request selects, so a router polling as it did last time gets its
304 and one that changed what it asks for gets the new representation.

The first read after start, and the first after the database was lost, marks the registry's return
(`RegistryReturn`, see registry/snapshot.py): sites alive when it went away get one liveness window.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from registry.snapshot import (DeflatedFragments, PackedTails, RegistryReturn, SnapshotData, SnapshotReader,
                               read_db_version)

MAX_PENDING_COMMITS = 1000  # beyond this many unapplied commits, a re-read is cheaper anyway


@dataclass(slots=True, frozen=True)
class Representation:
    """One of the ways a snapshot version is sent: its format (hashes packed or not) and content coding."""

    packed: bool = False
    deflate: bool = False

    @property
    def encoding(self) -> str | None:
        return "deflate" if self.deflate else None

    def etag(self, version: str) -> str:
        return f'"{version}{"-packed" if self.packed else ""}{"-deflate" if self.deflate else ""}"'

    @property
    def render_step(self) -> str:
        """Its label in the registry's snapshot metrics."""
        return "render" + ("_packed" if self.packed else "") + ("_deflate" if self.deflate else "")


@dataclass(slots=True)
class RenderedSnapshot:
    etag: str
    body: bytes | None  # None: the caller's ETag is current
    encoding: str | None = None  # "deflate": `body` is a zlib stream of the document; None: the document itself
    packed: bool = False  # the document is in the packed format (registry.wire.PACKED_SNAPSHOT_MEDIA_TYPE)


@dataclass(slots=True)
class _Body:
    version: str
    rendered_at: float
    body: bytes


class SnapshotCache:
    def __init__(self, engine: Engine, clock: Callable[[], float] = time.time, max_body_age_s: float = 1.0,
                 metrics=None) -> None:
        self._engine = engine
        self._metrics = metrics  # registry.metrics.RegistryMetrics: each read, apply and render is counted
        self._clock = clock
        self._max_body_age_s = max_body_age_s
        self._lock = threading.Lock()  # one rebuild at a time; concurrent callers reuse its result
        self._reader = SnapshotReader()
        self._data: SnapshotData | None = None
        self._bodies: dict[Representation, _Body] = {}
        self._packed = PackedTails()
        # One per format: a render forgets the compressed fragments it did not use, and the two formats'
        # capacity fragments differ.
        self._fragments = {False: DeflatedFragments(), True: DeflatedFragments()}
        self._commits_lock = threading.Lock()
        self._commits: dict[int, list[dict]] = {}  # registry version -> capacity rows that commit wrote
        self._returned: RegistryReturn | None = None  # None until the first read (and after losing the database)
        self._num_catch_ups = 0  # reads and applies so far: did the data move while a caller waited?

    def capacity_written(self, db_version: int, rows: list[dict]) -> None:
        """TelemetryStore listener: this process committed `rows`, moving the registry to `db_version`."""
        with self._commits_lock:
            if len(self._commits) >= MAX_PENDING_COMMITS:
                self._commits.clear()
            self._commits[db_version] = rows

    def get(self, if_none_match: str | None = None, deflate: bool = False, packed: bool = False) -> RenderedSnapshot:
        """The current snapshot (`packed`: in the packed format; `deflate`: as a zlib stream), or no body when
        `if_none_match` holds the ETag of that representation."""
        num_catch_ups = self._num_catch_ups
        try:
            db_version = read_db_version(self._engine)
        except OperationalError:
            with self._lock:  # the database is away: its return is a return of the registry
                self._data, self._returned = None, None
            raise
        with self._lock:
            if self._stale(db_version, num_catch_ups):
                self._catch_up(db_version)
                self._bodies.clear()
            now = self._clock()
            version = self._data.version_at(now)
            representation = Representation(packed, deflate)
            etag = representation.etag(version)
            if if_none_match is not None and etag in _etags(if_none_match):
                return RenderedSnapshot(etag, None, representation.encoding, packed)
            return RenderedSnapshot(etag, self._body(representation, version, now), representation.encoding, packed)

    def _body(self, representation: Representation, version: str, now: float) -> bytes:
        body = self._bodies.get(representation)
        if body is None or body.version != version or now - body.rendered_at > self._max_body_age_s:
            started = time.perf_counter()
            packed = self._packed if representation.packed else None
            if representation.deflate:
                rendered = self._data.render_deflated(now, self._fragments[representation.packed], packed)
            else:
                rendered = self._data.render(now, packed)
            body = self._bodies[representation] = _Body(version, now, rendered)
            self._observe(representation.render_step, started)
        return body.body

    def _stale(self, db_version: int, num_catch_ups: int) -> bool:
        """Whether the data must be brought to `db_version`, which this caller read before it waited
        for the lock. Data newer than that is current when another caller caught up meanwhile: routers
        polling together queue here, and with other replicas writing each of them used to read every
        row again. Newer data that did not move meanwhile means the database's version went back (a
        restored backup): read again."""
        data = self._data
        if data is None or data.db_version < db_version:
            return True
        return data.db_version > db_version and self._num_catch_ups == num_catch_ups

    def site_counts(self) -> Counter:
        """Sites per (state, alive) now, from the data brought up to the database's version."""
        self.get()
        with self._lock:
            return self._data.site_counts(self._clock())

    def _observe(self, step: str, started: float) -> None:
        if self._metrics is not None:
            self._metrics.snapshot_builds.labels(step).inc()
            self._metrics.snapshot_build_seconds.labels(step).observe(time.perf_counter() - started)

    def _catch_up(self, db_version: int) -> None:
        """Brings the data to at least `db_version`: by this process's commits when they account for
        every version in between, otherwise by reading (which may land on a newer version)."""
        data = self._data
        started = time.perf_counter()
        self._num_catch_ups += 1
        with self._commits_lock:
            commits = self._commits
            self._commits = {v: rows for v, rows in commits.items() if v > db_version}
        if data is not None and data.db_version < db_version and all(
                v in commits for v in range(data.db_version + 1, db_version + 1)):
            if all(data.apply_capacity(v, commits[v]) for v in range(data.db_version + 1, db_version + 1)):
                self._observe("apply", started)
                return
        self._data = self._reader.read(self._engine)
        self._observe("read", started)
        if self._returned is None:
            newest = self._data.newest_heartbeat()
            self._returned = RegistryReturn(self._clock(), newest if newest is not None else self._clock())
        self._data.apply_return(self._returned)
        with self._commits_lock:  # commits the read already includes
            self._commits = {v: rows for v, rows in self._commits.items() if v > self._data.db_version}


def _etags(header: str) -> set[str]:
    return {tag.strip().removeprefix("W/") for tag in header.split(",")}
