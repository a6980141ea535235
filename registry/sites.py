"""Sites and the models they serve: the operator's and the agents' writes to `sites`/`site_models`.

Every change runs in one transaction with its audit entry and a snapshot-version bump, so a
failure leaves nothing half-written. Heartbeats never touch these rows (they live in `capacity`),
so an agent's heartbeat can never undo an operator's cordon.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import fields

from sqlalchemy import Connection, Engine, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from registry import audit, tombstones, validate
from registry.db import writer
from registry.errors import Conflict, InvalidInput, NotFound
from registry.leases import LeaseClaim, check_held
from registry.records import ACTIVE_ROLES, ModelServed, Page, Site, SiteSpec, liveness_ttl_s
from registry.sql import SITE_MODELS, SITES, bump_version, load_site, load_sites, site_id
from registry.tables import CapacityRow
from registry.wire import RoleOffer, role_offer

CAPACITY = CapacityRow.__table__

SPEC_FIELDS = frozenset(f.name for f in fields(SiteSpec))


class SiteStore:
    def __init__(self, engine: Engine, clock: Callable[[], float] = time.time) -> None:
        self._read = engine
        self._write = writer(engine)
        self._clock = clock

    def create(self, name: str, spec: SiteSpec, actor: str) -> Site:
        validate.site_name(name)
        validate.site_spec(spec)
        try:
            with self._write.begin() as conn:
                return self._insert(conn, name, spec, actor)
        except IntegrityError as exc:
            # Two creates racing past each other; the unique index settles it.
            raise Conflict(f"a site named {name!r} already exists", "duplicate_site") from exc

    def put(self, name: str, spec: SiteSpec, actor: str) -> tuple[Site, bool]:
        """Creates the site or replaces its descriptive fields; returns (site, created). Idempotent,
        also when several callers put the same new site at once (one creates it, the others replace)."""
        validate.site_name(name)
        validate.site_spec(spec)
        try:
            return self._put(name, spec, actor)
        except (IntegrityError, Conflict):
            # Another put created the site between this one's lookup and its insert (on PostgreSQL,
            # FOR UPDATE locks no row that does not exist yet): it exists now, so this put replaces it.
            return self._put(name, spec, actor)

    def _put(self, name: str, spec: SiteSpec, actor: str) -> tuple[Site, bool]:
        with self._write.begin() as conn:
            existing = conn.execute(SITES.select().where(SITES.c.name == name).with_for_update()).first()
            if existing is None:
                return self._insert(conn, name, spec, actor), True
            self._write_spec(conn, existing.id, spec)
            audit.record(conn, self._clock(), actor, "site.put", name, _spec_json(spec))
            _drop_moot_active_role(conn, existing.id, name, spec, actor, self._clock())
            bump_version(conn)
            return load_site(conn, existing.id), False

    def update(self, name: str, changes: dict, actor: str, action: str = "site.update",
               expected_id: int | None = None) -> Site:
        """Changes only the given SiteSpec fields, validated together with the ones kept. `expected_id`: the
        site an agent's token resolved to; NotFound unless `name` is still that site (it may have been
        deleted, and another created under its name, since the token was checked)."""
        unknown = set(changes) - SPEC_FIELDS
        if unknown:
            raise InvalidInput(f"unknown site fields {sorted(unknown)}; allowed: {sorted(SPEC_FIELDS)}")
        with self._write.begin() as conn:
            found = site_id(conn, name, lock=True)
            if expected_id is not None and found != expected_id:
                raise NotFound(f"site {name!r} no longer exists", "site_not_found")
            current = load_site(conn, found)
            spec = SiteSpec(**{f: getattr(current, f) for f in SPEC_FIELDS})
            for key, value in changes.items():
                setattr(spec, key, value)
            validate.site_spec(spec)
            self._write_spec(conn, current.id, spec)
            audit.record(conn, self._clock(), actor, action, name, _spec_json(spec, only=changes))
            _drop_moot_active_role(conn, current.id, name, spec, actor, self._clock())
            bump_version(conn)
            return load_site(conn, current.id)

    def peers(self, site_id_: int) -> list[tuple[str, str]]:
        """(name, gRPC address) of every other live, active site serving one of this site's models:
        the paths its agent measures (node_agent.links)."""
        mine, theirs = SITE_MODELS.alias("mine"), SITE_MODELS.alias("theirs")
        query = (
            select(SITES.c.name, SITES.c.grpc_address).distinct()
            .join(theirs, theirs.c.site_id == SITES.c.id)
            .join(mine, (mine.c.model == theirs.c.model) & (mine.c.site_id == site_id_))
            .join(CAPACITY, CAPACITY.c.site_id == SITES.c.id)
            .where(SITES.c.id != site_id_, SITES.c.state == "active", SITES.c.grpc_address.is_not(None),
                   CAPACITY.c.reported_at >= self._clock() - liveness_ttl_s(SITES.c.heartbeat_interval_s))
            .order_by(SITES.c.name)
        )
        with self._read.connect() as conn:
            return [(row.name, row.grpc_address) for row in conn.execute(query)]

    def get(self, name: str) -> Site:
        with self._read.connect() as conn:
            return load_site(conn, site_id(conn, name))

    def list(self, limit: int = 100, cursor: str | None = None) -> Page[Site]:
        """Sites by name; `cursor` is the next_cursor of the previous page."""
        validate.page_limit(limit)
        where = SITES.c.name > validate.name_cursor(cursor) if cursor is not None else None
        with self._read.connect() as conn:
            sites = load_sites(conn, where, limit=limit + 1)
        next_cursor = sites[limit - 1].name if len(sites) > limit else None
        return Page(sites[:limit], next_cursor)

    def delete(self, name: str, actor: str, force: bool = False) -> None:
        """Deletes the site with its tokens, leaving their tombstones (registry.tombstones) so that an agent
        still running for it is told so and stops. An active site whose heartbeat is fresh has a running
        agent that would stop in the middle of serving: refused unless `force`."""
        with self._write.begin() as conn:
            found = site_id(conn, name, lock=True)
            now = self._clock()
            site = conn.execute(select(SITES.c.state, SITES.c.heartbeat_interval_s).where(SITES.c.id == found)).one()
            reported_at = conn.execute(select(CAPACITY.c.reported_at).where(CAPACITY.c.site_id == found)).scalar()
            age = None if reported_at is None else max(0.0, now - reported_at)
            ttl_s = liveness_ttl_s(site.heartbeat_interval_s)
            live = site.state == "active" and age is not None and age <= ttl_s
            if live and not force:
                raise _live_site(name, age, ttl_s)
            num_tombstoned = tombstones.bury(conn, found, name, now, actor)
            conn.execute(delete(SITES).where(SITES.c.id == found))  # cascades to models, capacity, links, tokens
            heartbeat_age_s = None if age is None else round(age, 3)
            audit.record(conn, now, actor, "site.delete", name,
                         {"state": site.state, "heartbeat_age_s": heartbeat_age_s, "live": live, "force": force,
                          "tokens_tombstoned": num_tombstoned})
            bump_version(conn)

    def cordon(self, name: str, actor: str) -> Site:
        return self._set_state(name, "cordoned", None, actor, "site.cordon")

    def uncordon(self, name: str, actor: str) -> Site:
        """Back to active. Refused (409) for a draining site whose agent still heartbeats: that agent
        is finishing its requests and then exits whatever the registry says, so "active" would be a
        site that vanishes. Once it has stopped (or its heartbeat is stale), uncordon it before
        starting it again; otherwise the restarted agent reads "draining" and drains at once."""
        return self._set_state(name, "active", None, actor, "site.uncordon", refuse_live_drain=True)

    def drain(self, name: str, deadline_s: float, actor: str) -> Site:
        validate.drain_deadline(deadline_s)
        return self._set_state(name, "draining", self._clock() + deadline_s, actor, "site.drain")

    def set_roles(self, name: str, roles: list[str], actor: str) -> Site:
        return self.update(name, {"roles": roles}, actor, "site.set_roles")

    def set_models(self, name: str, models: list[ModelServed], actor: str) -> Site:
        return self.update(name, {"models": models}, actor, "site.set_models")

    def set_active_role(self, name: str, role: str | None, actor: str, detail: dict,
                        lease: LeaseClaim | None = None) -> Site:
        """Narrows a site allowed both roles to one ("prefill" / "decode"), or back to both (None).

        The planner's lever: routers place by it from the next snapshot, the agent learns it from its
        next heartbeat's answer. `detail` (the reason and the figures behind it) goes to the audit log.
        The operator's allowed roles (and the models' roles) bound it: a site that does not offer both
        is never narrowed, and narrowing its roles later drops the pick (`_drop_moot_active_role`).
        With `lease`, the change is made only if that holder still holds the lease when it commits;
        otherwise LeaseLost, and nothing is written."""
        if role is not None and role not in ACTIVE_ROLES:
            raise InvalidInput(f"active role must be one of {list(ACTIVE_ROLES)} or null, got {role!r}")
        with self._write.begin() as conn:
            now = self._clock()
            if lease is not None:  # first: the lease row is locked before the site's, as `acquire` locks it alone
                check_held(conn, lease, now)
            current = load_site(conn, site_id(conn, name, lock=True))
            if role is not None and not offers_both_roles(current.roles, current.models):
                raise _fixed_role(name, current)
            conn.execute(update(SITES).where(SITES.c.id == current.id).values(active_role=role, active_role_since=now))
            audit.record(conn, now, actor, "site.active_role", name,
                         {"from": current.active_role or "both", "to": role or "both", **detail})
            bump_version(conn)
            return load_site(conn, current.id)

    def _set_state(self, name: str, state: str, deadline: float | None, actor: str, action: str,
                   refuse_live_drain: bool = False) -> Site:
        with self._write.begin() as conn:
            found = site_id(conn, name, lock=True)
            if refuse_live_drain:
                self._refuse_live_drain(conn, found, name)
            current = conn.execute(select(SITES.c.state).where(SITES.c.id == found)).scalar()
            if deadline is None and current == state:
                # A repeated cordon/uncordon changes nothing: not audited, and routers refetch nothing.
                return load_site(conn, found)
            conn.execute(update(SITES).where(SITES.c.id == found).values(
                state=state, drain_deadline=deadline, updated_at=self._clock(),
            ))
            audit.record(conn, self._clock(), actor, action, name, {"state": state, "drain_deadline": deadline})
            bump_version(conn)
            return load_site(conn, found)

    def _refuse_live_drain(self, conn: Connection, found: int, name: str) -> None:
        site = conn.execute(select(SITES.c.state, SITES.c.heartbeat_interval_s).where(SITES.c.id == found)).one()
        if site.state != "draining":
            return
        reported_at = conn.execute(select(CAPACITY.c.reported_at).where(CAPACITY.c.site_id == found)).scalar()
        if reported_at is None:
            return
        age = max(0.0, self._clock() - reported_at)
        ttl_s = liveness_ttl_s(site.heartbeat_interval_s)
        if age <= ttl_s:
            raise Conflict(f"site {name!r} is draining and its agent heartbeated {age:.1f}s ago: it is finishing "
                           f"its requests and then exits, so the drain cannot be called off. Uncordon the site once "
                           f"its agent has stopped (or its heartbeat is more than {ttl_s:g}s old), before starting "
                           f"the agent again", "site_is_draining")

    def _insert(self, conn: Connection, name: str, spec: SiteSpec, actor: str) -> Site:
        if conn.execute(SITES.select().where(SITES.c.name == name)).first() is not None:
            raise Conflict(f"a site named {name!r} already exists", "duplicate_site")
        now = self._clock()
        new_id = conn.execute(insert(SITES).values(
            name=name, state="active", created_at=now, **_spec_columns(spec, now),
        )).inserted_primary_key[0]
        _write_models(conn, new_id, spec.models)
        audit.record(conn, now, actor, "site.create", name, _spec_json(spec))
        bump_version(conn)
        return load_site(conn, new_id)

    def _write_spec(self, conn: Connection, found: int, spec: SiteSpec) -> None:
        conn.execute(update(SITES).where(SITES.c.id == found).values(**_spec_columns(spec, self._clock())))
        _write_models(conn, found, spec.models)


def _live_site(name: str, age: float, ttl_s: float) -> Conflict:
    return Conflict(f"site {name!r} is active and its agent heartbeated {age:.1f}s ago: deleting it would revoke the "
                    f"token that agent is using. Cordon it (POST /v1/admin/sites/{name}/cordon) or drain it (POST "
                    f"/v1/admin/sites/{name}/drain) first, or stop its agent and wait until its heartbeat is more "
                    f"than {ttl_s:g}s old; to delete it anyway, add ?force=true", "site_is_live")


def _fixed_role(name: str, site: Site) -> InvalidInput:
    offered = list(_offer(site.roles, site.models).roles)
    if not site.models:
        return InvalidInput(f"site {name!r} serves no model yet, so it offers no role; its active role cannot change "
                            f"until it serves a model in both roles", "fixed_role")
    return InvalidInput(f"site {name!r} offers only {offered} (roles {site.roles}, models' roles "
                        f"{[m.role for m in site.models]}); its active role cannot change", "fixed_role")


def _offer(roles: list[str], models: list[ModelServed]) -> RoleOffer:
    """The site's role offer without the planner's pick (registry.wire's one rule)."""
    return role_offer(roles, ((m.model, m.role) for m in models), None)


def offers_both_roles(roles: list[str], models: list[ModelServed]) -> bool:
    """Whether the pool planner may narrow the site to one role (the snapshot's `role_offer.flexible`)."""
    return _offer(roles, models).flexible


def _drop_moot_active_role(conn: Connection, found: int, name: str, spec: SiteSpec, actor: str, now: float) -> None:
    """The operator's word wins: once a site's roles (or its models' roles) no longer offer both, the
    planner's pick goes in the same change, audited. Kept, it would narrow the site to a role it may
    no longer take (allowed only decode, picked prefill: routers and the agent would give it nothing),
    and the planner never touches a site that does not offer both."""
    active_role = conn.execute(select(SITES.c.active_role).where(SITES.c.id == found)).scalar()
    if active_role is None or offers_both_roles(spec.roles, spec.models):
        return
    conn.execute(update(SITES).where(SITES.c.id == found).values(active_role=None, active_role_since=now))
    offered = list(_offer(spec.roles, spec.models).roles)
    audit.record(conn, now, actor, "site.active_role", name, {
        "from": active_role, "to": "both", "offered": offered,
        "reason": f"the site now offers only {offered}: the planner's pick of {active_role} no longer applies"})


def _write_models(conn: Connection, found: int, models: list[ModelServed]) -> None:
    conn.execute(delete(SITE_MODELS).where(SITE_MODELS.c.site_id == found))
    if models:
        conn.execute(insert(SITE_MODELS), [{"site_id": found, "model": m.model, "role": m.role,
                                            "kv_bytes_per_token": m.kv_bytes_per_token, "kv_format": m.kv_format}
                                           for m in models])


def _spec_columns(spec: SiteSpec, now: float) -> dict:
    return {
        "region": spec.region, "country": spec.country, "lat": spec.lat, "lon": spec.lon,
        "grpc_address": spec.grpc_address, "roles": json.dumps(spec.roles),
        "heartbeat_interval_s": spec.heartbeat_interval_s, "updated_at": now,
    }


def _spec_json(spec: SiteSpec, only: dict | None = None) -> dict:
    out = {f: getattr(spec, f) for f in (only or SPEC_FIELDS)}
    if "models" in out:
        out["models"] = [{"model": m.model, "role": m.role} for m in out["models"]]
    return out
