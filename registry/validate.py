"""Domain rules for registry input; each failure says which field to change and how.

The store calls these before writing, so nothing invalid reaches the database whichever way the
store is driven (HTTP service, launcher, tests). Heartbeats are checked by their wire contract,
registry.wire, when they are parsed.
"""

from __future__ import annotations

import math
import re

from registry.errors import InvalidInput
from registry.records import MODEL_ROLES, SITE_ROLES, ApiKeySpec, LinkMeasurement, ModelServed, SiteSpec

SITE_NAME = re.compile(r"[a-z0-9-]{1,63}")
REGION = re.compile(r"[a-z0-9-]{1,63}")
COUNTRY = re.compile(r"[A-Z]{2}")
HOST = re.compile(r"[A-Za-z0-9.\-_]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")
MAX_MODEL_ID = 200
MAX_KV_FORMAT = 200
MAX_KV_BYTES_PER_TOKEN = 2**40  # far above any model's (a 400B model in fp32 is ~4 MB per token)
MAX_ID = 2**63 - 1  # ids are 64-bit integer columns
MAX_HEARTBEAT_INTERVAL_S = 3600.0
MAX_RATE_LIMIT = 2**31 - 1  # per-minute limits are 32-bit integer columns


def site_name(name: str) -> str:
    if not isinstance(name, str) or not SITE_NAME.fullmatch(name):
        raise InvalidInput(f"site name {name!r} must be 1-63 characters of a-z, 0-9 and '-'", "invalid_site_name")
    return name


def site_spec(spec: SiteSpec) -> SiteSpec:
    if spec.region is not None and not REGION.fullmatch(spec.region):
        raise InvalidInput(f"region {spec.region!r} must be 1-63 characters of a-z, 0-9 and '-' (e.g. 'eu-west')")
    if spec.country is not None:
        # ASCII first: str.upper() turns 'ß' into 'SS' and 'ﬁ' into 'FI', codes nobody sent.
        if not (spec.country.isascii() and COUNTRY.fullmatch(spec.country.upper())):
            raise InvalidInput(f"country {spec.country!r} must be an ISO 3166-1 alpha-2 code such as 'DE'")
        spec.country = spec.country.upper()
    _coordinate("lat", spec.lat, 90.0)
    _coordinate("lon", spec.lon, 180.0)
    if (spec.lat is None) != (spec.lon is None):
        raise InvalidInput("give lat and lon together, or neither", "invalid_coordinates")
    if spec.grpc_address is not None:
        grpc_address(spec.grpc_address)
    spec.roles = roles(spec.roles)
    spec.models = models(spec.models)
    heartbeat_interval(spec.heartbeat_interval_s)
    return spec


def grpc_address(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not HOST.fullmatch(host) or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidInput(f"grpc_address {address!r} must be 'host:port' with a port in 1-65535", "invalid_address")
    return address


def roles(values: list[str]) -> list[str]:
    unknown = [r for r in values if r not in SITE_ROLES]
    if unknown or not values:
        raise InvalidInput(f"roles must be a non-empty subset of {list(SITE_ROLES)}, got {values!r}", "invalid_roles")
    return sorted(set(values), key=SITE_ROLES.index)


def models(values: list[ModelServed]) -> list[ModelServed]:
    seen: set[str] = set()
    for served in values:
        if not served.model or len(served.model) > MAX_MODEL_ID:
            raise InvalidInput(f"model id must be 1-{MAX_MODEL_ID} characters", "invalid_model")
        if served.role not in MODEL_ROLES:
            raise InvalidInput(f"model role {served.role!r} must be one of {list(MODEL_ROLES)}", "invalid_model")
        if served.model in seen:
            raise InvalidInput(f"model {served.model!r} is listed twice", "invalid_model")
        seen.add(served.model)
        kv_bytes = served.kv_bytes_per_token
        if kv_bytes is not None and (isinstance(kv_bytes, bool) or not 1 <= kv_bytes <= MAX_KV_BYTES_PER_TOKEN):
            raise InvalidInput(f"model {served.model!r}: kv_bytes_per_token must be an integer in "
                               f"[1, {MAX_KV_BYTES_PER_TOKEN}], got {kv_bytes!r}", "invalid_model")
        if served.kv_format is not None and not 1 <= len(served.kv_format) <= MAX_KV_FORMAT:
            raise InvalidInput(f"model {served.model!r}: kv_format must be 1-{MAX_KV_FORMAT} characters",
                               "invalid_model")
    return values


def heartbeat_interval(seconds: float) -> float:
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_HEARTBEAT_INTERVAL_S:
        raise InvalidInput(f"heartbeat_interval_s must be in (0, {MAX_HEARTBEAT_INTERVAL_S:g}]")
    return seconds


def drain_deadline(seconds: float) -> float:
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidInput("deadline_s must be a finite number of seconds >= 0")
    return seconds


def link(measurement: LinkMeasurement) -> LinkMeasurement:
    site_name(measurement.peer)
    for name in ("rtt_ms", "bandwidth_mbps"):
        value = getattr(measurement, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidInput(f"{name} must be a finite number >= 0")
    return measurement


def api_key_spec(spec: ApiKeySpec) -> ApiKeySpec:
    if not spec.name or len(spec.name) > 200:
        raise InvalidInput("API key name must be 1-200 characters")
    for region in spec.allowed_regions:
        if not REGION.fullmatch(region):
            raise InvalidInput(f"allowed region {region!r} must be 1-63 characters of a-z, 0-9 and '-'")
    for name in ("requests_per_minute", "tokens_per_minute"):
        value = getattr(spec, name)
        if value is not None and not 1 <= value <= MAX_RATE_LIMIT:
            raise InvalidInput(f"{name} must be in [1, {MAX_RATE_LIMIT}], or null for unlimited, got {value}")
    spec.allowed_regions = sorted(set(spec.allowed_regions))
    return spec


def id_cursor(cursor: str) -> int:
    """A next_cursor holding a row id. Only ASCII digits ('²' is a digit to str.isdigit, not to int)."""
    if not (cursor.isascii() and cursor.isdigit()) or int(cursor) > MAX_ID:
        raise InvalidInput("cursor must be the next_cursor of a previous page", "invalid_cursor")
    return int(cursor)


def name_cursor(cursor: str) -> str:
    """A next_cursor holding a site name."""
    if not SITE_NAME.fullmatch(cursor):
        raise InvalidInput("cursor must be the next_cursor of a previous page", "invalid_cursor")
    return cursor


def page_limit(limit: int) -> int:
    if not 1 <= limit <= 1000:
        raise InvalidInput("limit must be between 1 and 1000")
    return limit


def _coordinate(name: str, value: float | None, bound: float) -> None:
    if value is None:
        return
    if not math.isfinite(value) or not -bound <= value <= bound:
        raise InvalidInput(f"{name} must be between {-bound:g} and {bound:g}, got {value!r}", "invalid_coordinates")
