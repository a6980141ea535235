"""Request bodies of the registry HTTP API (types only; domain rules live in registry.validate).
The heartbeat's body is the wire contract shared with agents and routers, registry.wire.CapacityReport.

Unknown fields are refused, so a misspelt field is a 422 that names it rather than a silent no-op.
Types are strict, as in the heartbeat's contract: nothing is converted, so true is not 1, "12" is not
12 and "yes" is not true, and an integer field refuses 5.0 (write 5); a number field takes 5 or 5.0.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from registry.fleet import FleetReport, KeyDemand, RateCharge, UsageCount
from registry.placements import PlacedPair
from registry.records import DEFAULT_HEARTBEAT_INTERVAL_S, SITE_ROLES, ApiKeySpec, LinkMeasurement, ModelServed, SiteSpec

MAX_LIST = 10_000
MAX_COUNT = 2**53   # counts travel as JSON numbers: exact up to here
MAX_KEY_ID = 2**31 - 1


# Lone surrogates (JSON "\ud800") cannot be encoded for the database or an answer; control
# characters (NUL above all, which PostgreSQL refuses) belong in no name, id or key.
UNFIT_TEXT = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _text_is_printable_unicode(cls, value):
        if _has_unfit_text(value):
            raise ValueError("text must be valid Unicode without control characters")
        return value


def _has_unfit_text(value) -> bool:
    if isinstance(value, str):
        return UNFIT_TEXT.search(value) is not None
    if isinstance(value, list):
        return any(_has_unfit_text(item) for item in value)
    if isinstance(value, dict):
        return any(_has_unfit_text(k) or _has_unfit_text(v) for k, v in value.items())
    return False


class ModelServedBody(Body):
    model: str
    role: str = "both"
    kv_bytes_per_token: int | None = None
    kv_format: str | None = None

    def record(self) -> ModelServed:
        return ModelServed(self.model, self.role, self.kv_bytes_per_token, self.kv_format)


class SiteBody(Body):
    region: str | None = None
    country: str | None = None
    lat: float | None = None
    lon: float | None = None
    grpc_address: str | None = None
    roles: list[str] = Field(default_factory=lambda: list(SITE_ROLES))
    models: list[ModelServedBody] = Field(default_factory=list, max_length=MAX_LIST)
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S

    def spec(self) -> SiteSpec:
        fields = self.model_dump(exclude={"models", "name"})
        return SiteSpec(**fields, models=[m.record() for m in self.models])


class SiteCreateBody(SiteBody):
    name: str


class SitePatchBody(Body):
    region: str | None = None
    country: str | None = None
    lat: float | None = None
    lon: float | None = None
    grpc_address: str | None = None
    roles: list[str] | None = None
    models: list[ModelServedBody] | None = Field(default=None, max_length=MAX_LIST)
    heartbeat_interval_s: float | None = None

    def changes(self) -> dict:
        """Only the fields the caller sent; an explicit null clears a nullable field."""
        out = {name: getattr(self, name) for name in self.model_fields_set}
        if "models" in out:
            out["models"] = [m.record() for m in out["models"] or []]
        for required in ("roles", "heartbeat_interval_s"):
            if required in out and out[required] is None:
                del out[required]
        return out


class DrainBody(Body):
    deadline_s: float


class RolesBody(Body):
    roles: list[str]


class ModelsBody(Body):
    models: list[ModelServedBody] = Field(max_length=MAX_LIST)


class SiteTokenBody(Body):
    revoke_previous: bool = False


class ApiKeyBody(Body):
    name: str
    allowed_regions: list[str] = Field(default_factory=list)
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def spec(self) -> ApiKeySpec:
        return ApiKeySpec(self.name, list(self.allowed_regions), self.requests_per_minute, self.tokens_per_minute)


class ApiKeyLookupBody(Body):
    key: str


class RegistrationBody(Body):
    """An agent (re)announcing its site. Location fields left out keep their current values."""

    name: str | None = None  # when given, must be the site the token is bound to
    grpc_address: str
    models: list[ModelServedBody] = Field(max_length=MAX_LIST)
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    region: str | None = None
    country: str | None = None
    lat: float | None = None
    lon: float | None = None

    def changes(self) -> dict:
        out = {"grpc_address": self.grpc_address, "models": [m.record() for m in self.models],
               "heartbeat_interval_s": self.heartbeat_interval_s}
        for name in ("region", "country", "lat", "lon"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


class LinkBody(Body):
    peer: str
    rtt_ms: float
    bandwidth_mbps: float


class LinksBody(Body):
    links: list[LinkBody] = Field(max_length=MAX_LIST)

    def records(self) -> list[LinkMeasurement]:
        return [LinkMeasurement(link.peer, link.rtt_ms, link.bandwidth_mbps) for link in self.links]


class PlacedPairBody(Body):
    prefill_site: str = Field(max_length=63)
    decode_site: str = Field(max_length=63)
    num_requests: int = Field(ge=1)


class PlacementsBody(Body):
    """What a router placed since its last report (registry.placements)."""

    placements: list[PlacedPairBody] = Field(max_length=MAX_LIST)

    def records(self) -> list[PlacedPair]:
        return [PlacedPair(p.prefill_site, p.decode_site, p.num_requests) for p in self.placements]


KeyId = Field(ge=1, le=MAX_KEY_ID)
Count = Field(default=0, ge=0, le=MAX_COUNT)


class RateChargeBody(Body):
    key_id: int = KeyId
    slot: int = Field(ge=0, le=MAX_COUNT, description="epoch second of the router's clock")
    requests: int = Count
    tokens: int = Field(default=0, ge=-MAX_COUNT, le=MAX_COUNT, description="negative: tokens given back")


class UsageCountBody(Body):
    key_id: int = KeyId
    model: str = Field(min_length=1, max_length=200)
    hour: int = Field(ge=0, le=MAX_COUNT, description="epoch second starting the hour (a multiple of 3600)")
    requests: int = Count
    prompt_tokens: int = Count
    cached_prompt_tokens: int = Count
    completion_tokens: int = Count


class KeyDemandBody(Body):
    key_id: int = KeyId
    requests: float = Field(default=0.0, ge=0, le=MAX_COUNT)
    tokens: float = Field(default=0.0, ge=0, le=MAX_COUNT)
    remaining_requests: int = Count
    remaining_tokens: int = Count


class FleetReportBody(Body):
    """A router's report: what it charged each key per second, what it served, the grants it wants."""

    router_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    name: str = Field(default="", max_length=200)
    seq: int = Field(ge=1, le=MAX_COUNT, description="1, 2, 3, ... per router_id; a resent report keeps its number")
    charges: list[RateChargeBody] = Field(default_factory=list, max_length=MAX_LIST)
    usage: list[UsageCountBody] = Field(default_factory=list, max_length=MAX_LIST)
    demand: list[KeyDemandBody] = Field(default_factory=list, max_length=MAX_LIST)

    def report(self) -> FleetReport:
        return FleetReport(self.router_id, self.seq, self.name,
                           [RateCharge(**c.model_dump()) for c in self.charges],
                           [UsageCount(**u.model_dump()) for u in self.usage],
                           [KeyDemand(**d.model_dump()) for d in self.demand])
