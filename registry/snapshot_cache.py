"""Serving the snapshot cheaply: the rows are re-read only when the registry version moves,
the body is re-rendered at most every `max_body_age_s` (or when liveness flips), and a router
whose ETag is current gets a 304 without any rendering.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine

from registry.snapshot import SnapshotData, read_db_version, read_snapshot


@dataclass(slots=True)
class RenderedSnapshot:
    etag: str
    body: bytes | None  # None: the caller's ETag is current


class SnapshotCache:
    def __init__(self, engine: Engine, clock: Callable[[], float] = time.time, max_body_age_s: float = 1.0) -> None:
        self._engine = engine
        self._clock = clock
        self._max_body_age_s = max_body_age_s
        self._lock = threading.Lock()  # one rebuild at a time; concurrent callers reuse its result
        self._data: SnapshotData | None = None
        self._body: tuple[str, float, bytes] | None = None  # (version, rendered_at, body)

    def get(self, if_none_match: str | None = None) -> RenderedSnapshot:
        db_version = read_db_version(self._engine)
        with self._lock:
            if self._data is None or self._data.db_version != db_version:
                self._data = read_snapshot(self._engine)
                self._body = None
            data = self._data
            now = self._clock()
            version = data.version_at(now)
            etag = f'"{version}"'
            if if_none_match is not None and etag in _etags(if_none_match):
                return RenderedSnapshot(etag, None)
            if self._body is None or self._body[0] != version or now - self._body[1] > self._max_body_age_s:
                self._body = (version, now, data.render(now))
            return RenderedSnapshot(etag, self._body[2])


def _etags(header: str) -> set[str]:
    return {tag.strip().removeprefix("W/") for tag in header.split(",")}
