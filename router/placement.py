"""Placement: which site prefills a request and which decodes it. Pure functions over a Snapshot.

Filter. A site can take a role for a request when it serves the model in that role (site roles and
the model's role), is `active`, alive with a heartbeat younger than `heartbeat_max_age_s`, not
draining, in a region the API key allows, and has the KV blocks free: the uncached prompt for a
prefill site, prompt + the decode horizon for a decode site.

Cost model, in milliseconds (the router sits near its clients, so router↔site ≈ client↔site):
  client_rtt(s)   fresh measured link from the router's own site when present, else from distance
  queue(s)        in-flight prefill tokens ÷ prefill rate
  prefill(s)      uncached prompt tokens ÷ prefill rate; cached tokens come from the site's
                  prefix-cache summary (the leading run of prompt block hashes it holds)
  tpot(d)         (running sequences + 1) ÷ decode rate: this request's share of the site's throughput
  transfer(p, d)  link RTT + KV bytes ÷ link bandwidth: the agents' measurement of the pair when
                  fresh (measured at most `link_max_age_s` before the snapshot), else the RTT
                  implied by distance and `default_bandwidth_mbps` (see `kv_transfer_ms`)
  ttft            client_rtt(p) + queue(p) + prefill(p)
  colocated(s)    ttft(s) + horizon × tpot(s)
  split(p, d)     ttft(p) + transfer(p, d) + client_rtt(d) + horizon × tpot(d)
where horizon = min(max_tokens, expected_output_tokens). Rates a site has not measured yet take the
configured defaults. Colocation is just the pair (s, s), so a split wins only when its transfer
costs less than what it saves.

Only the best `shortlist` prefill sites and decode sites are paired, which keeps ranking linear in
the number of sites. The ranked list is the failover order; pairs touching a cooling site (passive
health) go last rather than vanishing, so a request still has somewhere to go.

Session affinity: among candidates within `affinity_slack` of the best score, the one with the
highest rendezvous hash of (session, pair) goes first. A session therefore keeps its sites while
they stay near-best, and moves when they become loaded, without any shared state between routers.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from engine.prefix_hash import prefix_hashes
from router.geometry import rtt_ms_between
from router.snapshot import Site, Snapshot

DEFAULT_BANDWIDTH_MBPS = 1000.0


@dataclass(slots=True)
class CostModel:
    expected_output_tokens: int = 128
    default_prefill_tokens_per_s: float = 4000.0
    default_decode_tokens_per_s: float = 500.0
    kv_bytes_per_token: int = 131072
    heartbeat_max_age_s: float = 15.0
    affinity_slack: float = 0.2
    default_bandwidth_mbps: float = DEFAULT_BANDWIDTH_MBPS
    link_max_age_s: float = 300.0      # older link measurements give way to the distance estimate
    shortlist: int = 8


@dataclass(slots=True)
class PlacementRequest:
    model: str
    prompt_ids: list[int]
    max_tokens: int
    client_lat: float
    client_lon: float
    client_site: str | None = None           # the router's own site, whose measured links give client RTTs
    allowed_regions: frozenset[str] = frozenset()  # empty: every region
    session_key: str | None = None


@dataclass(slots=True)
class Candidate:
    prefill_site: Site
    decode_site: Site
    ttft_ms: float
    tpot_ms: float
    transfer_ms: float
    score_ms: float
    num_cached_tokens: int

    @property
    def colocated(self) -> bool:
        return self.prefill_site.name == self.decode_site.name

    @property
    def site_names(self) -> tuple[str, str]:
        return self.prefill_site.name, self.decode_site.name


@dataclass(slots=True)
class _SiteCost:
    site: Site
    client_rtt_ms: float
    ttft_ms: float
    tpot_ms: float
    num_cached_tokens: int


def rank(snapshot: Snapshot, request: PlacementRequest, cost: CostModel,
         cooling: frozenset[str] | set[str] = frozenset()) -> list[Candidate]:
    """Every viable (prefill, decode) pair, best first; the failover order."""
    horizon = max(1, min(request.max_tokens, cost.expected_output_tokens))
    hashes_by_block_size: dict[int, list[int]] = {}
    prefill, decode = [], []
    for site in snapshot.sites:
        if not _usable(site, request, cost):
            continue
        site_cost = _site_cost(site, snapshot, request, cost, hashes_by_block_size)
        if site.serves(request.model, "prefill") and _fits_prefill(site, request, site_cost.num_cached_tokens):
            prefill.append(site_cost)
        if site.serves(request.model, "decode") and _fits_decode(site, request, horizon):
            decode.append(site_cost)
    prefill.sort(key=lambda c: c.ttft_ms)
    decode.sort(key=lambda c: c.client_rtt_ms + horizon * c.tpot_ms)
    candidates = _pairs(prefill, decode, snapshot, request, cost, horizon)
    candidates.sort(key=lambda c: (c.prefill_site.name in cooling or c.decode_site.name in cooling, c.score_ms))
    if request.session_key:
        _apply_affinity(candidates, request.session_key, cost.affinity_slack, cooling)
    return candidates


def _pairs(prefill: list[_SiteCost], decode: list[_SiteCost], snapshot: Snapshot, request: PlacementRequest,
           cost: CostModel, horizon: int) -> list[Candidate]:
    decode_by_name = {c.site.name: c for c in decode}
    short_prefill, short_decode = prefill[:cost.shortlist], decode[:cost.shortlist]
    pairs = {(p.site.name, d.site.name): (p, d) for p in short_prefill for d in short_decode}
    for p in prefill:  # colocation on any site that can do both, shortlisted or not
        if p.site.name in decode_by_name:
            pairs[(p.site.name, p.site.name)] = (p, decode_by_name[p.site.name])
    candidates = []
    for p, d in pairs.values():
        if p.site.name == d.site.name:
            transfer_ms, handoff_ms = 0.0, 0.0
        else:
            kv_bytes = len(request.prompt_ids) * cost.kv_bytes_per_token
            transfer_ms = kv_transfer_ms(p.site, d.site, snapshot, kv_bytes, cost)
            handoff_ms = transfer_ms + d.client_rtt_ms
        score = p.ttft_ms + handoff_ms + horizon * d.tpot_ms
        candidates.append(Candidate(p.site, d.site, p.ttft_ms, d.tpot_ms, transfer_ms, score, p.num_cached_tokens))
    return candidates


def _usable(site: Site, request: PlacementRequest, cost: CostModel) -> bool:
    cap = site.capacity
    return (site.state == "active" and site.alive and cap is not None and not cap.draining
            and site.heartbeat_age_s is not None and site.heartbeat_age_s <= cost.heartbeat_max_age_s
            and bool(site.grpc_address)
            and (not request.allowed_regions or site.region in request.allowed_regions))


def _fits_prefill(site: Site, request: PlacementRequest, num_cached_tokens: int) -> bool:
    cap = site.capacity
    return math.ceil((len(request.prompt_ids) - num_cached_tokens) / cap.block_size) + 1 <= cap.kv_blocks_free


def _fits_decode(site: Site, request: PlacementRequest, horizon: int) -> bool:
    cap = site.capacity
    return math.ceil((len(request.prompt_ids) + horizon) / cap.block_size) <= cap.kv_blocks_free


def _site_cost(site: Site, snapshot: Snapshot, request: PlacementRequest, cost: CostModel,
               hashes_by_block_size: dict[int, list[int]]) -> _SiteCost:
    cap = site.capacity
    client_rtt = _client_rtt_ms(site, snapshot, request, cost)
    num_cached = _cached_tokens(request.prompt_ids, cap.cache_block_size, cap.cached_hashes, hashes_by_block_size)
    prefill_rate = cap.prefill_tokens_per_s or cost.default_prefill_tokens_per_s
    queue_ms = 1000.0 * cap.inflight_prefill_tokens / prefill_rate
    prefill_ms = 1000.0 * (len(request.prompt_ids) - num_cached) / prefill_rate
    decode_rate = cap.decode_tokens_per_s or cost.default_decode_tokens_per_s
    tpot_ms = 1000.0 * (cap.num_running + 1) / decode_rate
    return _SiteCost(site, client_rtt, client_rtt + queue_ms + prefill_ms, tpot_ms, num_cached)


def _client_rtt_ms(site: Site, snapshot: Snapshot, request: PlacementRequest, cost: CostModel) -> float:
    if request.client_site is not None:
        if request.client_site == site.name:
            return 0.5
        link = snapshot.link(request.client_site, site.name, cost.link_max_age_s)
        if link is not None:
            return link.rtt_ms
    return rtt_ms_between(request.client_lat, request.client_lon, site.lat, site.lon)


def kv_transfer_ms(src: Site, dst: Site, snapshot: Snapshot, kv_bytes: int, cost: CostModel) -> float:
    """Moving `kv_bytes` of KV from src to dst: one round trip plus the bytes at the link's rate.

    The agents measure each pair (KV pulls, and small probes when idle); a measurement older than
    `link_max_age_s` says little about the path now, so distance and the default bandwidth stand in.
    """
    link = snapshot.link(src.name, dst.name, cost.link_max_age_s)
    if link is not None and link.bandwidth_mbps > 0:
        rtt_ms, bandwidth_mbps = link.rtt_ms, link.bandwidth_mbps
    else:
        rtt_ms, bandwidth_mbps = rtt_ms_between(src.lat, src.lon, dst.lat, dst.lon), cost.default_bandwidth_mbps
    return rtt_ms + 1000.0 * kv_bytes * 8 / (bandwidth_mbps * 1e6)


def _cached_tokens(prompt_ids: list[int], block_size: int, cached: frozenset[int],
                   hashes_by_block_size: dict[int, list[int]]) -> int:
    if not cached or block_size <= 0:
        return 0
    hashes = hashes_by_block_size.get(block_size)
    if hashes is None:  # one hashing pass per block size, shared by every site using it
        hashes = hashes_by_block_size[block_size] = prefix_hashes(prompt_ids, block_size)
    num_blocks = 0
    for h in hashes:
        if h not in cached:
            break
        num_blocks += 1
    # The last prompt token is always recomputed: its logits pick the first output token.
    return min(num_blocks * block_size, max(0, len(prompt_ids) - 1))


def _apply_affinity(candidates: list[Candidate], session_key: str, slack: float, cooling) -> None:
    if not candidates or candidates[0].prefill_site.name in cooling or candidates[0].decode_site.name in cooling:
        return
    limit = candidates[0].score_ms * (1.0 + slack) + 1.0
    near = [i for i, c in enumerate(candidates) if c.score_ms <= limit
            and c.prefill_site.name not in cooling and c.decode_site.name not in cooling]
    chosen = max(near, key=lambda i: _rendezvous(session_key, candidates[i]))
    candidates.insert(0, candidates.pop(chosen))


def _rendezvous(session_key: str, candidate: Candidate) -> int:
    text = f"{session_key}\x00{candidate.prefill_site.name}\x00{candidate.decode_site.name}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
