"""Recent placements: how many requests the routers placed on each (prefill site, decode site) pair.

Routers report what they placed every few seconds (`POST /v1/router/placements`); the counts are
added to the pair's row of the current PLACEMENT_WINDOW_S window, so any number of routers and
registry replicas add up. The dashboard reads the pairs of the last minutes as arcs
(`GET /v1/admin/placements`). Rows older than RETAIN_S are pruned as reports arrive. A pair naming
a site the registry no longer has is dropped: a report is a picture, not an order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine, delete, func, select

from registry.db import writer
from registry.errors import InvalidInput
from registry.sql import SITES, upsert
from registry.tables import PlacementRow

PLACEMENTS = PlacementRow.__table__
PLACEMENT_WINDOW_S = 10.0
RETAIN_S = 3600.0
MAX_WINDOW_S = RETAIN_S
MAX_COUNT = 1 << 40  # far above what a router places between two reports


@dataclass(slots=True)
class PlacedPair:
    prefill_site: str
    decode_site: str
    num_requests: int
    last_at: float = 0.0  # the end of the newest window the pair was placed in

    def to_json(self) -> dict:
        return {"prefill_site": self.prefill_site, "decode_site": self.decode_site,
                "num_requests": self.num_requests, "last_at": self.last_at}


class PlacementStore:
    def __init__(self, engine: Engine, clock: Callable[[], float] = time.time) -> None:
        self._read = engine
        self._write = writer(engine)
        self._clock = clock
        insert = upsert(engine, PLACEMENTS)
        self._add = insert.on_conflict_do_update(
            index_elements=[PLACEMENTS.c.prefill_site_id, PLACEMENTS.c.decode_site_id, PLACEMENTS.c.window_start],
            set_={"num_requests": PLACEMENTS.c.num_requests + insert.excluded.num_requests})

    def record(self, pairs: list[PlacedPair]) -> int:
        """Adds the counts to the current window; returns how many pairs were stored."""
        for pair in pairs:
            if not 0 < pair.num_requests <= MAX_COUNT:
                raise InvalidInput(f"num_requests must be in [1, {MAX_COUNT}], got {pair.num_requests}")
        now = self._clock()
        window = now - now % PLACEMENT_WINDOW_S
        totals: dict[tuple[str, str], int] = {}
        for pair in pairs:
            key = (pair.prefill_site, pair.decode_site)
            totals[key] = totals.get(key, 0) + pair.num_requests
        with self._write.begin() as conn:
            conn.execute(delete(PLACEMENTS).where(PLACEMENTS.c.window_start < now - RETAIN_S))
            if not totals:
                return 0
            names = {name for key in totals for name in key}
            ids = dict(conn.execute(select(SITES.c.name, SITES.c.id).where(SITES.c.name.in_(names))).all())
            rows = [{"prefill_site_id": ids[p], "decode_site_id": ids[d], "window_start": window, "num_requests": n}
                    for (p, d), n in sorted(totals.items()) if p in ids and d in ids]
            if rows:
                conn.execute(self._add, rows)
        return len(rows)

    def recent(self, window_s: float) -> list[PlacedPair]:
        """The pairs placed within the last `window_s` seconds, most requests first."""
        if not 0 < window_s <= MAX_WINDOW_S:
            raise InvalidInput(f"window_s must be in (0, {MAX_WINDOW_S:.0f}], got {window_s}")
        since = self._clock() - window_s
        prefill, decode = SITES.alias("prefill"), SITES.alias("decode")
        query = (select(prefill.c.name, decode.c.name, func.sum(PLACEMENTS.c.num_requests),
                        func.max(PLACEMENTS.c.window_start))
                 .join(prefill, prefill.c.id == PLACEMENTS.c.prefill_site_id)
                 .join(decode, decode.c.id == PLACEMENTS.c.decode_site_id)
                 .where(PLACEMENTS.c.window_start > since - PLACEMENT_WINDOW_S)
                 .group_by(prefill.c.name, decode.c.name))
        with self._read.connect() as conn:
            rows = conn.execute(query).all()
        pairs = [PlacedPair(p, d, int(n), last + PLACEMENT_WINDOW_S) for p, d, n, last in rows]
        return sorted(pairs, key=lambda pair: (-pair.num_requests, pair.prefill_site, pair.decode_site))
