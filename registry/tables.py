"""The registry's SQL schema as SQLAlchemy 2.x declarative models.

Times are epoch seconds in double-precision columns: identical on SQLite and PostgreSQL, and
liveness checks are a float comparison. JSON-valued fields (roles, allowed regions, prefix-cache
summaries, audit details) are stored as JSON text so both dialects treat them the same and the
snapshot can splice the stored text verbatim instead of re-encoding it.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class SiteRow(Base):
    __tablename__ = "sites"
    # A site's id is never reused (migration 0014; PostgreSQL's sequence never goes back): a replica that
    # still caches a deleted site's token must not reach a site created later under the same id.
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    region: Mapped[str | None] = mapped_column(String(63))
    country: Mapped[str | None] = mapped_column(String(2))
    lat: Mapped[float | None] = mapped_column(Float)
    lon: Mapped[float | None] = mapped_column(Float)
    grpc_address: Mapped[str | None] = mapped_column(String(300))
    state: Mapped[str] = mapped_column(String(16), default="active")
    drain_deadline: Mapped[float | None] = mapped_column(Float)
    roles: Mapped[str] = mapped_column(Text)  # JSON list of "prefill" / "decode"
    heartbeat_interval_s: Mapped[float] = mapped_column(Float, default=2.0)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    # The planner's choice among the allowed roles: "prefill" or "decode"; NULL means every allowed role.
    active_role: Mapped[str | None] = mapped_column(String(16))
    active_role_since: Mapped[float | None] = mapped_column(Float)


class SiteModelRow(Base):
    __tablename__ = "site_models"

    site_id: Mapped[int] = mapped_column(ForeignKey("sites.id", ondelete="CASCADE"), primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))  # prefill | decode | both
    # The site's own KV figures for the model (records.ModelServed); NULL when not reported.
    kv_bytes_per_token: Mapped[int | None] = mapped_column(BigInteger)
    kv_format: Mapped[str | None] = mapped_column(String(200))


class CapacityRow(Base):
    """The latest heartbeat of each site; one row per site, overwritten in place."""

    __tablename__ = "capacity"

    site_id: Mapped[int] = mapped_column(ForeignKey("sites.id", ondelete="CASCADE"), primary_key=True)
    kv_blocks_total: Mapped[int] = mapped_column(BigInteger)
    kv_blocks_free: Mapped[int] = mapped_column(BigInteger)
    block_size: Mapped[int] = mapped_column(Integer)
    num_running: Mapped[int] = mapped_column(Integer)
    num_waiting: Mapped[int] = mapped_column(Integer)
    inflight_prefill_tokens: Mapped[int] = mapped_column(BigInteger)
    inflight_decode_tokens: Mapped[int] = mapped_column(BigInteger)
    prefill_tokens_per_s: Mapped[float] = mapped_column(Float)
    decode_tokens_per_s: Mapped[float] = mapped_column(Float)
    decode_batch_size: Mapped[float] = mapped_column(Float, server_default="0")
    decode_kv_tokens: Mapped[float] = mapped_column(Float, server_default="0")
    prefix_cache_summary: Mapped[str | None] = mapped_column(Text)  # opaque JSON text
    draining: Mapped[bool] = mapped_column(Boolean)
    reported_at: Mapped[float] = mapped_column(Float)
    num_gpus: Mapped[int] = mapped_column(Integer, server_default="0")
    tensor_parallel_size: Mapped[int] = mapped_column(Integer, server_default="1")
    pipeline_parallel_size: Mapped[int] = mapped_column(Integer, server_default="1")
    expert_parallel_size: Mapped[int] = mapped_column(Integer, server_default="1")
    speculative_acceptance: Mapped[float] = mapped_column(Float, server_default="0")
    # Each model's own KV pool and prefix cache (registry.wire.ModelCapacity) as opaque JSON text, from an
    # agent hosting several models; NULL for one model or an older agent.
    models: Mapped[str | None] = mapped_column(Text)
    # The reported_at of the heartbeat that wrote `models`. A registry older than `models` (still serving
    # during a rolling upgrade) overwrites every other column of the row and leaves `models` as it was:
    # per-model figures older than the site's. Such a write moves reported_at and not this, so `models`
    # is read only where the two are equal (registry.telemetry.CAPACITY_COLUMNS); else the site's own
    # figures stand for every model, as for a single-model site.
    models_reported_at: Mapped[float | None] = mapped_column(Float)


class LinkRow(Base):
    __tablename__ = "links"

    src_site_id: Mapped[int] = mapped_column(ForeignKey("sites.id", ondelete="CASCADE"), primary_key=True)
    dst_site_id: Mapped[int] = mapped_column(ForeignKey("sites.id", ondelete="CASCADE"), primary_key=True)
    rtt_ms: Mapped[float] = mapped_column(Float)
    bandwidth_mbps: Mapped[float] = mapped_column(Float)
    measured_at: Mapped[float] = mapped_column(Float)


class ApiKeyRow(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    key_prefix: Mapped[str] = mapped_column(String(16))  # lets operators recognise a key
    allowed_regions: Mapped[str] = mapped_column(Text)  # JSON list; empty means every region
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float)


class SiteTokenRow(Base):
    __tablename__ = "site_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    site_id: Mapped[int] = mapped_column(ForeignKey("sites.id", ondelete="CASCADE"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(Float)


class SiteTombstoneRow(Base):
    """A token of a deleted site, kept as its hash for TOMBSTONE_TTL_S (registry/tombstones.py), so its
    agent is told its site was deleted (410 `site_deleted`) instead of that its token is unknown (401)."""

    __tablename__ = "site_tombstones"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    site_name: Mapped[str] = mapped_column(String(63))
    deleted_at: Mapped[float] = mapped_column(Float, index=True)
    deleted_by: Mapped[str] = mapped_column(String(200))


class AuditLogRow(Base):
    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Float)
    actor: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(200))
    detail: Mapped[str] = mapped_column(Text)  # JSON object


class LeaseRow(Base):
    """A named lease: whoever holds an unexpired row may do that job (one active planner)."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    holder: Mapped[str] = mapped_column(String(200))
    expires_at: Mapped[float] = mapped_column(Float)


class PlacementRow(Base):
    """Requests the routers placed on each (prefill site, decode site) pair, per window of
    PLACEMENT_WINDOW_S seconds: the dashboard's arcs. Recent only (registry.placements prunes)."""

    __tablename__ = "placements"

    prefill_site_id: Mapped[int] = mapped_column(ForeignKey("sites.id", ondelete="CASCADE"), primary_key=True)
    decode_site_id: Mapped[int] = mapped_column(ForeignKey("sites.id", ondelete="CASCADE"), primary_key=True)
    window_start: Mapped[float] = mapped_column(Float, primary_key=True, index=True)
    num_requests: Mapped[int] = mapped_column(BigInteger)


class RegistryVersionRow(Base):
    """One row whose counter moves on every change a router would see in the snapshot.

    Writers bump it as the last statement of their transaction, so whoever holds its row lock
    never waits on another lock (no deadlock through this hot row on PostgreSQL).
    """

    __tablename__ = "registry_version"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(BigInteger)


class FleetRouterRow(Base):
    """A router process that reports to the registry: its report sequence (a retried report is applied
    once) and when it last reported (the live routers a key's limit is shared by when the registry is away)."""

    __tablename__ = "fleet_routers"

    router_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    last_seq: Mapped[int] = mapped_column(BigInteger)
    first_report_at: Mapped[float] = mapped_column(Float)
    last_report_at: Mapped[float] = mapped_column(Float)


class RateUsageRow(Base):
    """What routers charged a key per second of their clocks (its rate-limit window; registry/allowance.py)."""

    __tablename__ = "rate_usage"

    key_id: Mapped[int] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True)
    slot: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # epoch second
    requests: Mapped[int] = mapped_column(BigInteger)
    tokens: Mapped[int] = mapped_column(BigInteger)


class RateHoldRow(Base):
    """One router's hold on a key's window: what it may have charged and not reported yet, and its demand."""

    __tablename__ = "rate_holds"

    key_id: Mapped[int] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True)
    router_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    tokens: Mapped[int] = mapped_column(BigInteger)
    demand_requests: Mapped[float] = mapped_column(Float)
    demand_tokens: Mapped[float] = mapped_column(Float)
    reported_at: Mapped[float] = mapped_column(Float)


class KeyUsageRow(Base):
    """Usage accounting: what each key was served, per model and hour, as clients saw it in `usage`."""

    __tablename__ = "key_usage"

    key_id: Mapped[int] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    hour: Mapped[int] = mapped_column(BigInteger, primary_key=True, index=True)  # epoch second starting the hour (UTC)
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
