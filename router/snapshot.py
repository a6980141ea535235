"""The registry snapshot as plain dataclasses: the only module that knows the wire names.

The registry sends {"version", "generated_at", "sites": [...], "links": [...]} (see
registry/snapshot.py). Placement reads only these classes, so a renamed field is a fix here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Capacity:
    kv_blocks_total: int
    kv_blocks_free: int
    block_size: int
    num_running: int = 0
    num_waiting: int = 0
    inflight_prefill_tokens: int = 0
    inflight_decode_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    draining: bool = False
    cache_block_size: int = 0          # block size of the prefix-cache summary (0: no summary)
    cached_hashes: frozenset[int] = frozenset()
    reported_at: float | None = None   # the registry's clock when this heartbeat arrived


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
    capacity: Capacity | None
    country: str | None = None

    def serves(self, model: str, role: str) -> bool:
        """role is "prefill" or "decode"; a "both" model entry serves either."""
        model_role = self.models.get(model)
        return model_role is not None and model_role in (role, "both") and role in self.roles


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

    def link(self, src: str, dst: str, max_age_s: float | None = None) -> Link | None:
        """The newest measured link in either direction (measurements are taken one way); with
        max_age_s, only one measured at most that long before the snapshot was generated."""
        found = [link for link in (self.links.get((src, dst)), self.links.get((dst, src))) if link is not None]
        if max_age_s is not None:
            found = [link for link in found if self.generated_at - link.measured_at <= max_age_s]
        return max(found, key=lambda link: link.measured_at, default=None)


def parse_capacity(doc: dict | None) -> Capacity | None:
    if doc is None:
        return None
    summary = doc.get("prefix_cache_summary") or {}
    hashes = frozenset(int(h, 16) for h in summary.get("hashes", ()))
    return Capacity(
        kv_blocks_total=int(doc.get("kv_blocks_total", 0)), kv_blocks_free=int(doc.get("kv_blocks_free", 0)),
        block_size=int(doc.get("block_size", 16)), num_running=int(doc.get("num_running", 0)),
        num_waiting=int(doc.get("num_waiting", 0)),
        inflight_prefill_tokens=int(doc.get("inflight_prefill_tokens", 0)),
        inflight_decode_tokens=int(doc.get("inflight_decode_tokens", 0)),
        prefill_tokens_per_s=float(doc.get("prefill_tokens_per_s") or 0.0),
        decode_tokens_per_s=float(doc.get("decode_tokens_per_s") or 0.0),
        draining=bool(doc.get("draining", False)),
        cache_block_size=int(summary.get("block_size", 0)) if hashes else 0, cached_hashes=hashes,
        reported_at=float(doc["reported_at"]) if doc.get("reported_at") is not None else None,
    )


def parse_site(doc: dict) -> Site:
    return Site(
        name=doc["name"], region=doc.get("region"), country=doc.get("country"), lat=doc.get("lat"), lon=doc.get("lon"),
        grpc_address=doc.get("grpc_address") or "", state=doc.get("state", "active"),
        roles=tuple(doc.get("roles") or ("prefill", "decode")),
        models={m["model"]: m.get("role", "both") for m in doc.get("models", ())},
        alive=bool(doc.get("alive", False)), heartbeat_age_s=doc.get("heartbeat_age_s"),
        capacity=parse_capacity(doc.get("capacity")),
    )


def parse_snapshot(doc: dict) -> Snapshot:
    links = {}
    for link in doc.get("links", ()):
        links[(link["src"], link["dst"])] = Link(link["src"], link["dst"], float(link["rtt_ms"]),
                                                 float(link["bandwidth_mbps"]), float(link.get("measured_at") or 0.0))
    sites = [parse_site(s) for s in doc.get("sites", ())]
    return Snapshot(str(doc.get("version", "")), float(doc.get("generated_at", 0.0)), sites, links)
