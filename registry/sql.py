"""Small SQL helpers every part of the store shares: the snapshot version, site lookups, upserts."""

from __future__ import annotations

import json

from sqlalchemy import Connection, Engine, select, update
from sqlalchemy.dialects import postgresql, sqlite

from registry.errors import NotFound
from registry.records import ModelServed, Site
from registry.validate import SITE_NAME
from registry.tables import RegistryVersionRow, SiteModelRow, SiteRow

SITES = SiteRow.__table__
SITE_MODELS = SiteModelRow.__table__
VERSION = RegistryVersionRow.__table__


def bump_version(conn: Connection) -> int:
    """Marks the snapshot as changed and returns the new version; must be the last statement of the
    transaction (see RegistryVersionRow)."""
    query = update(VERSION).where(VERSION.c.id == 1).values(version=VERSION.c.version + 1).returning(VERSION.c.version)
    return conn.execute(query).scalar_one()


def read_version(conn: Connection) -> int:
    return conn.execute(select(VERSION.c.version).where(VERSION.c.id == 1)).scalar_one()


def upsert(engine: Engine | Connection, table):
    """An INSERT that can take ON CONFLICT DO UPDATE, for whichever dialect the engine speaks."""
    module = sqlite if engine.dialect.name == "sqlite" else postgresql
    return module.insert(table)


def site_id(conn: Connection, name: str, lock: bool = False) -> int:
    if not SITE_NAME.fullmatch(name):  # no such site can exist; and PostgreSQL refuses some text (NUL)
        raise NotFound(f"unknown site {name!r}", "site_not_found")
    query = select(SITES.c.id).where(SITES.c.name == name)
    if lock:
        query = query.with_for_update()  # PostgreSQL row lock; SQLite's BEGIN IMMEDIATE already serialises
    found = conn.execute(query).scalar_one_or_none()
    if found is None:
        raise NotFound(f"unknown site {name!r}", "site_not_found")
    return found


def load_sites(conn: Connection, where=None, order_by=None, limit: int | None = None) -> list[Site]:
    query = select(SITES)
    if where is not None:
        query = query.where(where)
    query = query.order_by(order_by if order_by is not None else SITES.c.name)
    if limit is not None:
        query = query.limit(limit)
    rows = conn.execute(query).all()
    models = _models_by_site(conn, [row.id for row in rows])
    return [_site(row, models.get(row.id, [])) for row in rows]


def load_site(conn: Connection, site_id_: int) -> Site:
    sites = load_sites(conn, SITES.c.id == site_id_)
    if not sites:
        raise NotFound(f"site {site_id_} no longer exists", "site_not_found")
    return sites[0]


def _models_by_site(conn: Connection, site_ids: list[int]) -> dict[int, list[ModelServed]]:
    if not site_ids:
        return {}
    query = select(SITE_MODELS).where(SITE_MODELS.c.site_id.in_(site_ids)).order_by(SITE_MODELS.c.model)
    out: dict[int, list[ModelServed]] = {}
    for row in conn.execute(query):
        out.setdefault(row.site_id, []).append(ModelServed(row.model, row.role, row.kv_bytes_per_token,
                                                           row.kv_format))
    return out


def _site(row, models: list[ModelServed]) -> Site:
    return Site(
        id=row.id, name=row.name, region=row.region, country=row.country, lat=row.lat, lon=row.lon,
        grpc_address=row.grpc_address, state=row.state, drain_deadline=row.drain_deadline,
        roles=json.loads(row.roles), models=models, heartbeat_interval_s=row.heartbeat_interval_s,
        created_at=row.created_at, updated_at=row.updated_at, active_role=row.active_role,
        active_role_since=row.active_role_since,
    )
