"""The routers' reports: usage accounting per key, model and hour, and the global rate-limit windows
with each router's grant (the algorithm and its bound: registry/allowance.py).

    result = store.fleet.apply_report(report)    # one transaction; a retried report is applied once
    rows = store.fleet.usage(UsageQuery(key_id=3, start=..., end=..., granularity="hour"))

A report is applied once: each router numbers its reports (`seq`, one in flight at a time) and the
router's row keeps the last number applied, locked for the transaction, so a report resent after a
lost answer — to this replica or another — adds nothing twice, yet still gets fresh grants. The answer
also names the report's keys that are revoked (`revoked_keys`): the router stops honouring its cached
copy of them at once, so a revocation reaches every router that uses the key within a report. Rows
that can no longer matter are pruned as reports come: window slots older than the window, holds past
HOLD_S, and routers silent for ROUTER_RETENTION_S (a report resent after that long would count twice;
a router resends only while it gets no answer, so that means a day without one reaching the registry).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Engine, bindparam, case, delete, func, select, update
from sqlalchemy.exc import OperationalError

from registry.allowance import (GRANT_TTL_S, HOLD_S, MAX_FUTURE_SLOTS, Held, allowance, reset_s,
                                window_start)
from registry.db import writer
from registry.errors import InvalidInput
from registry.sql import upsert
from registry.tables import ApiKeyRow, FleetRouterRow, KeyUsageRow, RateHoldRow, RateUsageRow

log = logging.getLogger(__name__)

API_KEYS = ApiKeyRow.__table__
ROUTERS = FleetRouterRow.__table__
RATE_USAGE = RateUsageRow.__table__
HOLDS = RateHoldRow.__table__
USAGE = KeyUsageRow.__table__
LIVE_ROUTER_S = 10.0          # a router that reported within this long counts as live
ROUTER_RETENTION_S = 86400.0
PRUNE_EVERY_S = 60.0
PRUNE_MARGIN_S = 60
GRANULARITIES = {"hour": 3600, "day": 86400}
USAGE_COUNTS = ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")
LIMITS = (("requests", "requests_per_minute"), ("tokens", "tokens_per_minute"))


@dataclass(slots=True)
class RateCharge:
    """What a router charged one key in one second of its clock; tokens < 0 are give-backs."""

    key_id: int
    slot: int
    requests: int = 0
    tokens: int = 0


@dataclass(slots=True)
class UsageCount:
    """Requests served to one key for one model in one hour, with the token counts clients saw."""

    key_id: int
    model: str
    hour: int
    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(slots=True)
class KeyDemand:
    """A key the router wants a grant for: what it was asked lately and what it still had when it reported."""

    key_id: int
    requests: float = 0.0
    tokens: float = 0.0
    remaining_requests: int = 0
    remaining_tokens: int = 0


@dataclass(slots=True)
class FleetReport:
    router_id: str
    seq: int
    name: str = ""
    charges: list[RateCharge] = field(default_factory=list)
    usage: list[UsageCount] = field(default_factory=list)
    demand: list[KeyDemand] = field(default_factory=list)


@dataclass(slots=True)
class LimitGrant:
    grant: int
    free: int          # the key's room in its window (≤ 0: full)
    unallocated: int
    reset_s: float     # when the oldest charge leaves the window

    def to_json(self) -> dict:
        return {"grant": self.grant, "free": self.free, "unallocated": self.unallocated,
                "reset_s": round(self.reset_s, 3)}


@dataclass(slots=True)
class KeyGrant:
    """A router's allowance for one key; None for a limit the key does not have (unlimited)."""

    key_id: int
    requests: LimitGrant | None
    tokens: LimitGrant | None
    known: bool = True   # False: no such key, or it was revoked

    def to_json(self) -> dict:
        return {"key_id": self.key_id, "known": self.known,
                "requests": self.requests.to_json() if self.requests else None,
                "tokens": self.tokens.to_json() if self.tokens else None}


@dataclass(slots=True)
class ReportResult:
    applied: bool               # False: this report had been applied before (a resend)
    grants: list[KeyGrant]
    live_routers: int
    grant_ttl_s: float = GRANT_TTL_S
    revoked_keys: list[int] = field(default_factory=list)   # keys in the report now revoked (or unknown)

    def to_json(self) -> dict:
        return {"applied": self.applied, "live_routers": self.live_routers, "grant_ttl_s": self.grant_ttl_s,
                "grants": [grant.to_json() for grant in self.grants], "revoked_keys": self.revoked_keys}


@dataclass(slots=True)
class UsageQuery:
    key_id: int | None = None
    model: str | None = None
    start: float | None = None     # epoch seconds, inclusive (rows of hours starting at or after it)
    end: float | None = None       # exclusive
    granularity: str = "hour"      # hour | day | total


@dataclass(slots=True)
class UsageRow:
    key_id: int
    key_name: str
    model: str
    period_start: int | None       # None for granularity "total"
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int

    def to_json(self) -> dict:
        return {"key_id": self.key_id, "key_name": self.key_name, "model": self.model,
                "period_start": self.period_start, "requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "cached_prompt_tokens": self.cached_prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass(slots=True)
class RouterRecord:
    router_id: str
    name: str
    last_seq: int
    first_report_at: float
    last_report_at: float
    live: bool

    def to_json(self) -> dict:
        return {"router_id": self.router_id, "name": self.name, "last_seq": self.last_seq,
                "first_report_at": self.first_report_at, "last_report_at": self.last_report_at, "live": self.live}


class FleetStore:
    def __init__(self, engine: Engine, clock: Callable[[], float] = time.time) -> None:
        self._read = engine
        self._write = writer(engine)
        self._clock = clock
        self._last_prune = -math.inf
        self._add_charge = _adding_upsert(engine, RATE_USAGE, ["key_id", "slot"], ["requests", "tokens"])
        self._add_usage = _adding_upsert(engine, USAGE, ["key_id", "model", "hour"], list(USAGE_COUNTS))
        insert_hold = upsert(engine, HOLDS)
        self._put_hold = insert_hold.on_conflict_do_update(
            index_elements=["key_id", "router_id"],
            set_={c: insert_hold.excluded[c] for c in ("requests", "tokens", "demand_requests", "demand_tokens",
                                                       "reported_at")})
        self._new_router = upsert(engine, ROUTERS).on_conflict_do_nothing(index_elements=["router_id"])
        # Built once: a report runs about ten statements, and building each anew cost more than running it.
        ids = bindparam("ids", expanding=True)
        self._last_seq = select(ROUTERS.c.last_seq).where(ROUTERS.c.router_id == bindparam("router_id")).with_for_update()
        self._move_router = update(ROUTERS).where(ROUTERS.c.router_id == bindparam("rid")).values(
            last_report_at=bindparam("now"),
            last_seq=case((ROUTERS.c.last_seq < bindparam("seq"), bindparam("seq")), else_=ROUTERS.c.last_seq),
            name=case((bindparam("new_name") == "", ROUTERS.c.name), else_=bindparam("new_name")))
        self._lock_keys = (select(API_KEYS.c.id, API_KEYS.c.requests_per_minute, API_KEYS.c.tokens_per_minute,
                                  API_KEYS.c.revoked).where(API_KEYS.c.id.in_(ids)).order_by(API_KEYS.c.id)
                           .with_for_update())
        self._windows = (select(RATE_USAGE.c.key_id, func.sum(RATE_USAGE.c.requests).label("requests"),
                                func.sum(RATE_USAGE.c.tokens).label("tokens"),
                                func.min(RATE_USAGE.c.slot).label("oldest"))
                         .where(RATE_USAGE.c.key_id.in_(ids), RATE_USAGE.c.slot >= bindparam("oldest"))
                         .group_by(RATE_USAGE.c.key_id))
        self._others = select(HOLDS).where(HOLDS.c.key_id.in_(ids), HOLDS.c.router_id != bindparam("router_id"),
                                           HOLDS.c.reported_at > bindparam("since"))
        self._release = delete(HOLDS).where(HOLDS.c.router_id == bindparam("router_id"), HOLDS.c.key_id.not_in(ids))
        self._live = (select(func.count()).select_from(ROUTERS)
                      .where(ROUTERS.c.last_report_at > bindparam("since")))

    # -- reports -------------------------------------------------------------------------------

    def apply_report(self, report: FleetReport) -> ReportResult:
        _check_report(report)
        now = self._clock()
        with self._write.begin() as conn:
            applied = self._claim(conn, report, now)
            key_ids = sorted({c.key_id for c in report.charges} | {u.key_id for u in report.usage}
                             | {d.key_id for d in report.demand})
            # Every report touching a key holds the key's row until it commits: grants see one order.
            keys = {row.id: row for row in conn.execute(self._lock_keys, {"ids": key_ids})}
            unknown = set(key_ids) - set(keys)
            revoked = sorted(unknown | {key_id for key_id, key in keys.items() if key.revoked})
            if unknown:
                log.warning("router %s reported unknown API key id(s) %s; dropped", report.router_id, sorted(unknown))
            if applied:
                self._record(conn, report, keys, now)
            live = conn.execute(self._live, {"since": now - LIVE_ROUTER_S}).scalar_one()
            grants = self._grant(conn, report, keys, now, live)
            conn.execute(self._release, {"router_id": report.router_id, "ids": [g.key_id for g in grants if g.known]})
        if now - self._last_prune > PRUNE_EVERY_S:
            self._last_prune = now
            self._prune(now)
        return ReportResult(applied, grants, live, revoked_keys=revoked)

    def _claim(self, conn, report: FleetReport, now: float) -> bool:
        """Locks the router's row and moves it to this report; False when the report was applied before."""
        conn.execute(self._new_router, {"router_id": report.router_id, "name": report.name, "last_seq": 0,
                                        "first_report_at": now, "last_report_at": now})
        last_seq = conn.execute(self._last_seq, {"router_id": report.router_id}).scalar_one()
        conn.execute(self._move_router, {"rid": report.router_id, "now": now, "seq": report.seq,
                                         "new_name": report.name})
        return report.seq > last_seq

    def _record(self, conn, report: FleetReport, keys: dict, now: float) -> None:
        oldest, newest = window_start(now), math.floor(now) + MAX_FUTURE_SLOTS
        charges: dict[tuple[int, int], list[int]] = {}
        for charge in report.charges:
            if charge.key_id not in keys or charge.slot < oldest:
                continue   # outside every window: the usage table keeps what was served
            total = charges.setdefault((charge.key_id, min(charge.slot, newest)), [0, 0])
            total[0] += charge.requests
            total[1] += charge.tokens
        if charges:
            conn.execute(self._add_charge, [{"key_id": k, "slot": s, "requests": r, "tokens": t}
                                            for (k, s), (r, t) in sorted(charges.items())])
        usage = [{"key_id": u.key_id, "model": u.model, "hour": u.hour, **{c: getattr(u, c) for c in USAGE_COUNTS}}
                 for u in report.usage if u.key_id in keys]
        if usage:
            conn.execute(self._add_usage, sorted(usage, key=lambda u: (u["key_id"], u["model"], u["hour"])))

    def _grant(self, conn, report: FleetReport, keys: dict, now: float, live: int) -> list[KeyGrant]:
        demand = {d.key_id: d for d in report.demand}
        if not demand:
            return []
        wanted = sorted(demand)
        oldest = window_start(now)
        windows = {row.key_id: row for row in conn.execute(self._windows, {"ids": wanted, "oldest": oldest})}
        others: dict[int, list] = {}
        for row in conn.execute(self._others, {"ids": wanted, "router_id": report.router_id, "since": now - HOLD_S}):
            others.setdefault(row.key_id, []).append(row)
        grants, holds = [], []
        for key_id in wanted:
            key = keys.get(key_id)
            if key is None or key.revoked:
                grants.append(KeyGrant(key_id, None, None, known=False))
                continue
            window, asked = windows.get(key_id), demand[key_id]
            limits, hold = {}, {"requests": 0, "tokens": 0}
            for name, column in LIMITS:
                limit = getattr(key, column)
                if limit is None:
                    limits[name] = None
                    continue
                standing = [Held(getattr(o, name), getattr(o, f"demand_{name}") if o.reported_at > now - GRANT_TTL_S
                                 else 0.0) for o in others.get(key_id, [])]
                result = allowance(limit, int(getattr(window, name) or 0) if window else 0,
                                   max(0.0, getattr(asked, name)), max(0, getattr(asked, f"remaining_{name}")),
                                   standing, live)
                hold[name] = result.hold
                limits[name] = LimitGrant(result.grant, result.free, result.unallocated,
                                          reset_s(now, window.oldest if window else None))
            grants.append(KeyGrant(key_id, limits["requests"], limits["tokens"]))
            holds.append({"key_id": key_id, "router_id": report.router_id, **hold,
                          "demand_requests": asked.requests, "demand_tokens": asked.tokens, "reported_at": now})
        if holds:
            conn.execute(self._put_hold, holds)
        return grants

    def _prune(self, now: float) -> None:
        """Drops rows no report can need again, one short transaction each, after the report committed
        (never inside it: a report's locks are only ever on rows of the keys it locked). The cut-offs
        keep a minute of margin, so no report still running writes near them."""
        statements = (delete(RATE_USAGE).where(RATE_USAGE.c.slot < window_start(now) - PRUNE_MARGIN_S),
                      delete(HOLDS).where(HOLDS.c.reported_at < now - HOLD_S - PRUNE_MARGIN_S),
                      delete(ROUTERS).where(ROUTERS.c.last_report_at < now - ROUTER_RETENTION_S))
        for statement in statements:
            try:
                with self._write.begin() as conn:
                    conn.execute(statement)
            except OperationalError as exc:  # e.g. a deadlock another report won: the next prune retries
                log.info("pruning fleet rows: %s", exc.orig)

    # -- reading -------------------------------------------------------------------------------

    def usage(self, query: UsageQuery) -> list[UsageRow]:
        """Usage rows summed to the granularity (UTC hours or days, or one row per key and model)."""
        if query.granularity not in (*GRANULARITIES, "total"):
            raise InvalidInput(f"granularity: must be one of hour, day, total; got {query.granularity!r}",
                               "invalid_granularity")
        if query.start is not None and query.end is not None and query.end <= query.start:
            raise InvalidInput("to must be later than from", "invalid_range")
        conditions = []
        if query.key_id is not None:
            conditions.append(USAGE.c.key_id == query.key_id)
        if query.model is not None:
            conditions.append(USAGE.c.model == query.model)
        if query.start is not None:
            conditions.append(USAGE.c.hour >= math.ceil(query.start))
        if query.end is not None:
            conditions.append(USAGE.c.hour < math.ceil(query.end))
        sums = [func.sum(USAGE.c[c]).label(c) for c in USAGE_COUNTS]
        group = [USAGE.c.key_id, API_KEYS.c.name, USAGE.c.model]
        period = None
        if query.granularity != "total":
            size = GRANULARITIES[query.granularity]
            period = (USAGE.c.hour - USAGE.c.hour % size).label("period_start")
            group.append(period)
        statement = (select(*group, *sums).select_from(USAGE.join(API_KEYS, API_KEYS.c.id == USAGE.c.key_id))
                     .where(*conditions).group_by(*group)
                     .order_by(*([period] if period is not None else []), USAGE.c.key_id, USAGE.c.model))
        with self._read.connect() as conn:
            rows = conn.execute(statement).all()
        return [UsageRow(row.key_id, row.name, row.model, int(row.period_start) if period is not None else None,
                         *(int(getattr(row, c)) for c in USAGE_COUNTS)) for row in rows]

    def routers(self) -> list[RouterRecord]:
        now = self._clock()
        with self._read.connect() as conn:
            rows = conn.execute(select(ROUTERS).order_by(ROUTERS.c.first_report_at, ROUTERS.c.router_id)).all()
        return [RouterRecord(r.router_id, r.name, r.last_seq, r.first_report_at, r.last_report_at,
                             r.last_report_at > now - LIVE_ROUTER_S) for r in rows]


def _adding_upsert(engine: Engine, table, keys: list[str], counts: list[str]):
    """INSERT ... ON CONFLICT DO UPDATE that adds the new counts to the stored ones."""
    statement = upsert(engine, table)
    return statement.on_conflict_do_update(index_elements=keys,
                                           set_={c: table.c[c] + statement.excluded[c] for c in counts})


def _check_report(report: FleetReport) -> None:
    if report.seq < 1:
        raise InvalidInput("seq: must be at least 1", "invalid_field")
    for usage in report.usage:
        if usage.hour % 3600:
            raise InvalidInput(f"usage hour {usage.hour} is not the start of an hour (a multiple of 3600)",
                               "invalid_field")
