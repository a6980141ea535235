"""The registry snapshot as plain dataclasses: the only module that knows the wire names.

The registry sends {"version", "generated_at", "sites": [...], "links": [...]} (see
registry/snapshot.py); each site's capacity is the wire contract's `SnapshotCapacity`
(registry.wire), the same definition the agent builds and the registry validates. Placement reads
only these classes, so a renamed field is a fix here. Prefix-cache hashes come as hex strings or, where
the registry offers the packed format the router asks for, packed (`SnapshotCacheSummary` reads both,
and placement sees the same integers either way).

Parsing is per site and per link: one the router cannot parse is left out of its snapshot and
logged (one line per site and minute), and every other site is served. Only a document that is
not a snapshot at all raises `SnapshotError`, and the feed keeps its last good snapshot.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from registry.log_limit import LogLimiter
from registry.wire import RoleOffer, SnapshotCapacity, read_role_offer

log = logging.getLogger(__name__)
_skipped = LogLimiter(log, interval_s=60.0)


class SnapshotError(ValueError):
    """The registry's answer is not a snapshot document."""


@dataclass(slots=True, frozen=True)
class ModelKV:
    """A site's own KV figures for one model (its agent registers them): bytes per token, in its KV
    dtype, and the format two sites must share for KV to move between them (0 / "": not reported)."""

    bytes_per_token: int = 0
    kv_format: str = ""


@dataclass(slots=True)
class Site:
    name: str
    region: str | None
    lat: float | None
    lon: float | None
    grpc_address: str
    state: str                          # active | cordoned | draining
    roles: tuple[str, ...]              # site-level roles: prefill, decode
    models: dict[str, str]              # model -> prefill | decode | both
    alive: bool
    heartbeat_age_s: float | None
    capacity: SnapshotCapacity | None
    offer: RoleOffer                    # the registry's `role_offer`: which roles the site takes each model's work in
    country: str | None = None
    active_role: str | None = None      # the pool planner's pick among the allowed roles; None: all of them
    model_kv: dict[str, ModelKV] = field(default_factory=dict)  # the site's own KV figures, where it reported them

    def serves(self, model: str, role: str) -> bool:
        """role is "prefill" or "decode": as the registry published it (registry.wire.RoleOffer)."""
        return self.offer.serves(model, role)


@dataclass(slots=True)
class Link:
    src: str
    dst: str
    rtt_ms: float
    bandwidth_mbps: float
    measured_at: float = 0.0            # the registry's clock, like the snapshot's generated_at


@dataclass(slots=True)
class Snapshot:
    version: str
    generated_at: float
    sites: list[Site]
    links: dict[tuple[str, str], Link] = field(default_factory=dict)
    # What placement derives once per snapshot (router/placement.py); a copy made with
    # dataclasses.replace (another view of the sites) starts with an empty one.
    placement_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def link(self, src: str, dst: str, max_age_s: float | None = None) -> Link | None:
        """The newest measured link in either direction (measurements are taken one way); with
        max_age_s, only one measured at most that long before the snapshot was generated."""
        found = [link for link in (self.links.get((src, dst)), self.links.get((dst, src))) if link is not None]
        if max_age_s is not None:
            found = [link for link in found if self.generated_at - link.measured_at <= max_age_s]
        return max(found, key=lambda link: link.measured_at, default=None)


def parse_snapshot(doc: dict) -> Snapshot:
    """The snapshot of every site and link that parses; raises SnapshotError only for a document
    that is not a snapshot at all."""
    if not isinstance(doc, dict) or not isinstance(doc.get("sites", []), list) \
            or not isinstance(doc.get("links", []), list):
        raise SnapshotError("the registry's snapshot is not an object with 'sites' and 'links' lists")
    version, generated_at = doc.get("version", ""), doc.get("generated_at", 0.0)
    if not isinstance(version, str) or isinstance(generated_at, bool) or not isinstance(generated_at, int | float):
        raise SnapshotError("the registry's snapshot needs a string 'version' and a numeric 'generated_at'")
    sites = [site for site in map(_parse_or_skip(parse_site, "site"), doc.get("sites", ())) if site is not None]
    links = {}
    for link in map(_parse_or_skip(parse_link, "link"), doc.get("links", ())):
        if link is not None:
            links[(link.src, link.dst)] = link
    return Snapshot(version, float(generated_at), sites, links)


def parse_site(doc: dict) -> Site:
    """One site of the snapshot; raises KeyError, TypeError or ValueError when it is malformed."""
    models, model_kv = {}, {}
    for entry in _list(doc, "models"):
        model = _text(entry, "model")
        models[model] = _text(entry, "role", "both")
        kv = ModelKV(int(_optional_number(entry, "kv_bytes_per_token") or 0), _optional_text(entry, "kv_format") or "")
        if kv.bytes_per_token < 0:
            raise ValueError("kv_bytes_per_token must not be negative")
        if kv != ModelKV():
            model_kv[model] = kv
    capacity = doc.get("capacity")
    return Site(
        name=_text(doc, "name"), region=_optional_text(doc, "region"), country=_optional_text(doc, "country"),
        lat=_optional_number(doc, "lat"), lon=_optional_number(doc, "lon"),
        grpc_address=_optional_text(doc, "grpc_address") or "", state=_text(doc, "state", "active"),
        roles=tuple(_text_items(doc, "roles") or ("prefill", "decode")), models=models,
        alive=_bool(doc, "alive"), heartbeat_age_s=_optional_number(doc, "heartbeat_age_s"),
        capacity=None if capacity is None else SnapshotCapacity.model_validate(capacity),
        offer=read_role_offer(doc),  # an older registry's snapshot has none: the same rule derives it
        active_role=_optional_text(doc, "active_role"), model_kv=model_kv,
    )


def parse_link(doc: dict) -> Link:
    return Link(_text(doc, "src"), _text(doc, "dst"), _number(doc, "rtt_ms"), _number(doc, "bandwidth_mbps"),
                _optional_number(doc, "measured_at") or 0.0)


def _parse_or_skip(parse, kind: str):
    def parse_one(doc):
        try:
            if not isinstance(doc, dict):
                raise TypeError(f"a {kind} must be a JSON object")
            return parse(doc)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            name = doc.get("name") if isinstance(doc, dict) and kind == "site" else None
            label = f"{kind} {name!r}" if isinstance(name, str) else f"a {kind}"
            _skipped.warning((kind, name if isinstance(name, str) else None),
                             "left %s out of the snapshot: it does not parse (%s)", label, _one_line(exc))
            return None
    return parse_one


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return (text[:300] + "...") if len(text) > 300 else text or type(exc).__name__


def _text(doc: dict, key: str, default: str | None = None) -> str:
    value = doc.get(key, default)
    if not isinstance(value, str) or not value:
        raise TypeError(f"{key} must be a non-empty string")
    return value


def _optional_text(doc: dict, key: str) -> str | None:
    value = doc.get(key)
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{key} must be a string or null")
    return value


def _text_items(doc: dict, key: str) -> list[str]:
    values = doc.get(key) or []
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise TypeError(f"{key} must be a list of strings")
    return values


def _list(doc: dict, key: str) -> list:
    values = doc.get(key) or []
    if not isinstance(values, list):
        raise TypeError(f"{key} must be a list")
    return values


def _bool(doc: dict, key: str) -> bool:
    value = doc.get(key, False)
    if not isinstance(value, bool):
        raise TypeError(f"{key} must be true or false")
    return value


def _number(doc: dict, key: str) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"{key} must be a finite number")
    return float(value)


def _optional_number(doc: dict, key: str) -> float | None:
    return None if doc.get(key) is None else _number(doc, key)
