"""The audit log: who changed what, when; written in the same transaction as the change itself."""

from __future__ import annotations

import json

from sqlalchemy import Connection, Engine, insert, select

from registry import validate
from registry.records import AuditEntry, Page
from registry.tables import AuditLogRow

AUDIT = AuditLogRow.__table__


def record(conn: Connection, at: float, actor: str, action: str, target: str, detail: dict | None = None) -> None:
    conn.execute(insert(AUDIT).values(
        at=at, actor=actor[:200], action=action, target=target[:200], detail=json.dumps(detail or {}, default=str),
    ))


class AuditLog:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def list(self, limit: int = 100, cursor: str | None = None) -> Page[AuditEntry]:
        """Newest first; `cursor` is the next_cursor of the previous page."""
        validate.page_limit(limit)
        query = select(AUDIT).order_by(AUDIT.c.id.desc()).limit(limit + 1)
        if cursor is not None:
            query = query.where(AUDIT.c.id < validate.id_cursor(cursor))
        with self._engine.connect() as conn:
            rows = conn.execute(query).all()
        entries = [AuditEntry(r.id, r.at, r.actor, r.action, r.target, json.loads(r.detail)) for r in rows[:limit]]
        next_cursor = str(entries[-1].id) if len(rows) > limit else None
        return Page(entries, next_cursor)
