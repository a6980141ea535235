"""Named leases in the database: at most one holder at a time does a job (the planner), however
many registry processes run. A holder renews before expiry; a crashed holder's lease lapses.

Holding the lease when a tick starts is not enough for a write made later in it: a holder that
stalls past its lease (a long GC pause, a slow database) may find another holder in its place. Such a
write therefore checks the lease inside its own transaction (`check_held`), locking the lease row so
that nobody can take it before that transaction commits; without the lease nothing is written.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from registry.db import writer
from registry.errors import Conflict
from registry.tables import LeaseRow

LEASES = LeaseRow.__table__


@dataclass(slots=True, frozen=True)
class LeaseClaim:
    """Who claims to hold which lease, for a write that must happen only while they do."""

    name: str
    holder: str


class LeaseLost(Conflict):
    """The writer no longer holds the lease its write depends on: nothing was written."""

    code = "lease_lost"


def check_held(conn: Connection, claim: LeaseClaim, now: float) -> None:
    """Inside the caller's transaction: raises LeaseLost unless `claim.holder` holds the lease unexpired
    at `now`. The row stays locked until that transaction ends (PostgreSQL: FOR UPDATE; SQLite's write
    transaction is already exclusive), so an `acquire` by another holder waits for the commit."""
    row = conn.execute(select(LEASES.c.holder, LEASES.c.expires_at)
                       .where(LEASES.c.name == claim.name).with_for_update()).first()
    if row is None or row.holder != claim.holder or row.expires_at <= now:
        why = ("nobody holds it" if row is None else f"{row.holder} holds it" if row.holder != claim.holder
               else "it expired")
        raise LeaseLost(f"{claim.holder} no longer holds the {claim.name!r} lease: {why}")


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
