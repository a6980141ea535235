"""Tombstones of deleted sites: what lets the agent of a deleted site learn that its site is gone.

Deleting a site deletes its tokens, and an unknown token is a 401, which an agent cannot tell from a
mistyped token: it would retry forever, serving on, never learning to drain. So the delete keeps, in
its own transaction, the SHA-256 of every token the site had (never the token), with the site's name,
when and by whom (`site_tombstones`); a later call with one of those tokens is answered 410
`site_deleted` (registry.auth), and the agent drains and exits (node_agent/daemon.py).

Tombstones are kept TOMBSTONE_TTL_S (30 days): long enough for any agent still running to call once
more, short enough that the table stays small; older ones are neither read nor kept (each delete prunes
them). A site created again under the same name has new tokens, never tombstoned: the old tombstones
stay apart from it and keep stopping the deleted incarnation's agents, if any still run.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import Connection, delete, insert, select

from registry.tables import SiteTokenRow, SiteTombstoneRow

TOMBSTONES = SiteTombstoneRow.__table__
SITE_TOKENS = SiteTokenRow.__table__
TOMBSTONE_TTL_S = 30 * 24 * 3600.0


@dataclass(slots=True, frozen=True)
class DeletedSite:
    """The site a tombstoned token belonged to: its name, when it was deleted (epoch s) and by whom."""

    name: str
    deleted_at: float
    deleted_by: str

    def message(self) -> str:
        return (f"site {self.name!r} was deleted from the registry at {iso_time(self.deleted_at)} by "
                f"{self.deleted_by}: this token was that site's and no longer works, so its agent drains and stops; to serve as "
                f"{self.name!r} again, create the site anew and give its agent a newly issued token")

    def to_json(self) -> dict:
        return {"site": self.name, "deleted_at": self.deleted_at, "deleted_by": self.deleted_by}


def iso_time(epoch_s: float) -> str:
    """UTC, to the second: what a log line and an error message show."""
    return datetime.fromtimestamp(epoch_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def bury(conn: Connection, site_id: int, name: str, now: float, actor: str) -> int:
    """Tombstones the site's tokens, in the transaction that deletes it (before its tokens go), and prunes
    tombstones past TOMBSTONE_TTL_S. Returns how many tokens were tombstoned."""
    conn.execute(delete(TOMBSTONES).where(TOMBSTONES.c.deleted_at < now - TOMBSTONE_TTL_S))
    hashes = conn.execute(select(SITE_TOKENS.c.token_hash).where(SITE_TOKENS.c.site_id == site_id)).scalars().all()
    if hashes:
        conn.execute(insert(TOMBSTONES), [{"token_hash": token_hash, "site_name": name, "deleted_at": now,
                                           "deleted_by": actor[:200]} for token_hash in hashes])
    return len(hashes)


def deleted_sites(conn: Connection, hashes: list[str], now: float) -> dict[str, DeletedSite]:
    """The deleted site of each tombstoned token hash among `hashes` (tombstones younger than the TTL)."""
    query = (select(TOMBSTONES.c.token_hash, TOMBSTONES.c.site_name, TOMBSTONES.c.deleted_at, TOMBSTONES.c.deleted_by)
             .where(TOMBSTONES.c.token_hash.in_(hashes), TOMBSTONES.c.deleted_at >= now - TOMBSTONE_TTL_S))
    return {row.token_hash: DeletedSite(row.site_name, row.deleted_at, row.deleted_by) for row in conn.execute(query)}
