"""Plain records the store reads and writes: sites, links, keys, audit entries (a heartbeat's capacity
is the wire contract's registry.wire.CapacityReport).

They know nothing of SQL or HTTP; `to_json` gives the wire shape the service and client share.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Generic, TypeVar

SITE_STATES = ("active", "cordoned", "draining")
SITE_ROLES = ("prefill", "decode")
ACTIVE_ROLES = SITE_ROLES  # what the planner may narrow a site that is allowed both to
MODEL_ROLES = ("prefill", "decode", "both")
DEFAULT_HEARTBEAT_INTERVAL_S = 2.0
TTL_HEARTBEATS = 3  # a site is down after this many heartbeat intervals without one

T = TypeVar("T")


def liveness_ttl_s(heartbeat_interval_s: float) -> float:
    """How long a site's last heartbeat keeps it alive: the routers' snapshot, the peers an agent
    measures and the guard on deleting a live site all count a site alive while
    `now - reported_at <= liveness_ttl_s(its interval)`."""
    return TTL_HEARTBEATS * heartbeat_interval_s


@dataclass(slots=True)
class ModelServed:
    model: str
    role: str = "both"
    # The site's own KV figures for the model, as its agent registers them (None: not reported,
    # e.g. an operator's entry or an older agent): bytes per token (the site's KV dtype), and the
    # format two sites must share for KV to move between them (engine KVLayout.kv_format).
    kv_bytes_per_token: int | None = None
    kv_format: str | None = None


@dataclass(slots=True)
class SiteSpec:
    """The descriptive fields of a site, as an operator or the site's agent supplies them."""

    region: str | None = None
    country: str | None = None
    lat: float | None = None
    lon: float | None = None
    grpc_address: str | None = None
    roles: list[str] = field(default_factory=lambda: list(SITE_ROLES))
    models: list[ModelServed] = field(default_factory=list)
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S


@dataclass(slots=True)
class Site:
    id: int
    name: str
    region: str | None
    country: str | None
    lat: float | None
    lon: float | None
    grpc_address: str | None
    state: str
    drain_deadline: float | None
    roles: list[str]
    models: list[ModelServed]
    heartbeat_interval_s: float
    created_at: float
    updated_at: float
    active_role: str | None = None        # the planner's pick among `roles`; None: all of them
    active_role_since: float | None = None

    def to_json(self) -> dict:
        out = asdict(self)
        del out["id"]
        # a model's KV figures appear only where the site reported them, as in the snapshot
        out["models"] = [{k: v for k, v in served.items() if v is not None} for served in out["models"]]
        return out


@dataclass(slots=True)
class SiteStatus:
    """What an agent learns back from a heartbeat: the operator's intent for its site."""

    state: str
    drain_deadline: float | None
    active_role: str | None = None  # the planner's pick: take only this role's new work; None: every allowed role

    def to_json(self) -> dict:
        return {"state": self.state, "drain_deadline": self.drain_deadline, "active_role": self.active_role}


@dataclass(slots=True)
class LinkMeasurement:
    peer: str
    rtt_ms: float
    bandwidth_mbps: float


@dataclass(slots=True)
class ApiKeySpec:
    name: str
    allowed_regions: list[str] = field(default_factory=list)  # empty: every region
    requests_per_minute: int | None = None  # None: unlimited
    tokens_per_minute: int | None = None


@dataclass(slots=True)
class ApiKey:
    id: int
    name: str
    key_prefix: str
    allowed_regions: list[str]
    requests_per_minute: int | None
    tokens_per_minute: int | None
    revoked: bool
    created_at: float
    revoked_at: float | None

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class AuditEntry:
    id: int
    at: float
    actor: str
    action: str
    target: str
    detail: dict

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class Page(Generic[T]):
    items: list[T]
    next_cursor: str | None
