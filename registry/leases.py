"""Named leases in the database: at most one holder at a time does a job (the planner), however
many registry processes run. A holder renews before expiry; a crashed holder's lease lapses."""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlalchemy import Engine, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from registry.db import writer
from registry.tables import LeaseRow

LEASES = LeaseRow.__table__


class LeaseStore:
    def __init__(self, engine: Engine, clock: Callable[[], float] = time.time) -> None:
        self._write = writer(engine)
        self._clock = clock

    def acquire(self, name: str, holder: str, ttl_s: float) -> bool:
        """Takes or renews the lease for ttl_s; False while someone else holds it unexpired."""
        now = self._clock()
        try:
            with self._write.begin() as conn:
                row = conn.execute(select(LEASES).where(LEASES.c.name == name).with_for_update()).first()
                if row is None:
                    conn.execute(insert(LEASES).values(name=name, holder=holder, expires_at=now + ttl_s))
                    return True
                if row.holder != holder and row.expires_at > now:
                    return False
                conn.execute(update(LEASES).where(LEASES.c.name == name).values(holder=holder, expires_at=now + ttl_s))
                return True
        except IntegrityError:  # another holder inserted the row first (PostgreSQL: no row to lock yet)
            return False

    def release(self, name: str, holder: str) -> None:
        with self._write.begin() as conn:
            conn.execute(delete(LEASES).where(LEASES.c.name == name, LEASES.c.holder == holder))
