"""Placement: which site prefills a request and which decodes it. Pure functions over a Snapshot.

Filter. A site can take a role for a request when it serves the model in that role (site roles and
the model's role), is live (`active`, alive with a heartbeat younger than `heartbeat_max_age_s`, not
draining), in a region the API key allows, and has the KV blocks free: the uncached prompt for a
prefill site, prompt + the decode horizon for a decode site. The models live sites can serve at all
(`servable_models`) are what the router offers; any other model is unknown to it.

Inputs. Each site's figures are its latest heartbeat plus `pending`: what this router placed there
since that heartbeat (router/ledger.py), so a burst does not see the same idle site twenty times.
The model's KV bytes per token come from the agents' `GetModelInfo` (dtype-aware: their engine's
KV dtype and layout); `CostModel.kv_bytes_per_token` stands in only when that is unknown.

Cost model, in milliseconds (the router sits near its clients, so router↔site ≈ client↔site):
  client_rtt(s)   fresh measured link from the router's own site when present, else from distance
  queue(s)        (in-flight prefill tokens + pending prefill tokens) ÷ prefill rate
  prefill(s)      uncached prompt tokens ÷ prefill rate; cached tokens come from the site's
                  prefix-cache summary (the leading run of prompt block hashes it holds)
  tpot(d)         the time of one decode step on d once this request has joined it:
                    step(b, k) = unit(d) × (step_fixed + b + k × kv_bytes_per_token ÷ seq_kv_bytes)
                  b sequences reading k KV tokens: each sequence costs one unit, a step's fixed
                  cost (weights read once per step) `decode_step_fixed` units, and reading KV
                  one unit per `decode_seq_kv_bytes` bytes. unit(d) is calibrated from the decode
                  rate the site measured under the load it reports (rate = b₀ tokens per step of
                  step(b₀, k₀), k₀ = its KV blocks in use); an idle site's rate is read as one
                  sequence's. This request joins the sequences still decoding over its horizon
                  (running, capped at in-flight decode tokens ÷ horizon, with their share of the
                  KV) and reads its own prompt + half the horizon.
  transfer(p, d)  link RTT + KV bytes ÷ link bandwidth: the agents' measurement of the pair when
                  fresh (measured at most `link_max_age_s` before the snapshot), else the RTT
                  implied by distance and `default_bandwidth_mbps` (see `kv_transfer_ms`);
                  KV bytes = prompt tokens × the model's KV bytes per token
  ttft            client_rtt(p) + queue(p) + prefill(p)
  colocated(s)    ttft(s) + horizon × tpot(s)
  split(p, d)     ttft(p) + transfer(p, d) + client_rtt(d) + horizon × tpot(d)
where horizon = min(max_tokens, expected_output_tokens). Rates a site has not measured yet take the
configured defaults. Colocation is just the pair (s, s), so a split wins only when its transfer
costs less than what it saves. With `allow_split` off only colocated pairs are candidates (an
operator who wants no KV moving between sites; prefill-only and decode-only sites then get no work).

Only the best `shortlist` prefill sites and decode sites are paired, which keeps ranking linear in
the number of sites. The ranked list is the failover order; pairs touching a cooling site (passive
health) go last rather than vanishing, so a request still has somewhere to go.

Sessions. A request with a session key (`x-session-affinity`, else the OpenAI `user` field) whose
router remembers where the session last ran (`session_pair`) stays on that pair while its score is
within `session_margin` (a fraction) of the best; beyond that it moves, so a session follows its
prefix cache but not onto an overloaded site. A session this router does not know yet (new, or
seen by another router) goes, among the candidates within `affinity_slack` of the best, to the
one with the highest rendezvous hash of (session, pair): every router picks the same pair for it
without sharing state.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

from engine.prefix_hash import prefix_hashes
from registry.wire import SnapshotCapacity
from router.geometry import rtt_ms_between
from router.snapshot import Site, Snapshot

DEFAULT_BANDWIDTH_MBPS = 1000.0


@dataclass(slots=True)
class CostModel:
    expected_output_tokens: int = 128
    default_prefill_tokens_per_s: float = 4000.0
    default_decode_tokens_per_s: float = 500.0
    kv_bytes_per_token: int = 131072   # only for a model whose agents have not said theirs
    # A decode step's fixed cost in sequences' worth of work: ~1 where compute dominates (CPU
    # engines), tens on GPUs, where the weights are read once per step for the whole batch.
    decode_step_fixed: float = 8.0
    # KV bytes a step reads in the time it spends on one sequence's own work.
    decode_seq_kv_bytes: float = float(256 << 20)
    heartbeat_max_age_s: float = 15.0
    affinity_slack: float = 0.2        # near-equal candidates for a session this router does not know
    session_margin: float = 0.5        # a known session stays while its pair is within 50% of the best
    default_bandwidth_mbps: float = DEFAULT_BANDWIDTH_MBPS
    link_max_age_s: float = 300.0      # older link measurements give way to the distance estimate
    shortlist: int = 8
    allow_split: bool = True


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
    session_pair: tuple[str, str] | None = None  # (prefill, decode) sites where this session last ran
    kv_bytes_per_token: int = 0              # the model's, from GetModelInfo; 0: the cost model's default


@dataclass(slots=True)
class PendingLoad:
    """What this router placed on a site since the heartbeat the snapshot holds (router/ledger.py)."""

    prefill_tokens: int = 0   # uncached prompt tokens to prefill
    num_seqs: int = 0         # sequences that will decode there
    decode_tokens: int = 0    # their output budgets (max_tokens), like the agents' in-flight decode tokens
    kv_tokens: int = 0        # KV they hold once admitted (their prompts)


NO_PENDING = PendingLoad()


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
         cooling: frozenset[str] | set[str] = frozenset(),
         pending: Mapping[str, PendingLoad] | None = None) -> list[Candidate]:
    """Every viable (prefill, decode) pair, best first; the failover order."""
    horizon = max(1, min(request.max_tokens, cost.expected_output_tokens))
    kv_bytes_per_token = request.kv_bytes_per_token or cost.kv_bytes_per_token
    pending = pending or {}
    hashes_by_block_size: dict[int, list[int]] = {}
    prefill, decode = [], []
    for site in snapshot.sites:
        if not _usable(site, request, cost):
            continue
        load = pending.get(site.name, NO_PENDING)
        site_cost = _site_cost(site, load, snapshot, request, cost, horizon, kv_bytes_per_token,
                               hashes_by_block_size)
        if site.serves(request.model, "prefill") and _fits_prefill(site, load, request, site_cost.num_cached_tokens):
            prefill.append(site_cost)
        if site.serves(request.model, "decode") and _fits_decode(site, load, request, horizon):
            decode.append(site_cost)
    prefill.sort(key=lambda c: c.ttft_ms)
    decode.sort(key=lambda c: c.client_rtt_ms + horizon * c.tpot_ms)
    candidates = _pairs(prefill, decode, snapshot, request, cost, horizon, kv_bytes_per_token)
    candidates.sort(key=lambda c: (c.prefill_site.name in cooling or c.decode_site.name in cooling, c.score_ms))
    if request.session_key:
        _apply_session(candidates, request, cost, cooling)
    return candidates


def _pairs(prefill: list[_SiteCost], decode: list[_SiteCost], snapshot: Snapshot, request: PlacementRequest,
           cost: CostModel, horizon: int, kv_bytes_per_token: int) -> list[Candidate]:
    decode_by_name = {c.site.name: c for c in decode}
    short_prefill, short_decode = prefill[:cost.shortlist], decode[:cost.shortlist]
    pairs = {(p.site.name, d.site.name): (p, d) for p in short_prefill for d in short_decode
             if cost.allow_split or p.site.name == d.site.name}
    for p in prefill:  # colocation on any site that can do both, shortlisted or not
        if p.site.name in decode_by_name:
            pairs[(p.site.name, p.site.name)] = (p, decode_by_name[p.site.name])
    kv_bytes = len(request.prompt_ids) * kv_bytes_per_token
    candidates = []
    for p, d in pairs.values():
        if p.site.name == d.site.name:
            transfer_ms, handoff_ms = 0.0, 0.0
        else:
            transfer_ms = kv_transfer_ms(p.site, d.site, snapshot, kv_bytes, cost)
            handoff_ms = transfer_ms + d.client_rtt_ms
        score = p.ttft_ms + handoff_ms + horizon * d.tpot_ms
        candidates.append(Candidate(p.site, d.site, p.ttft_ms, d.tpot_ms, transfer_ms, score, p.num_cached_tokens))
    return candidates


def is_live(site: Site, cost: CostModel) -> bool:
    """The site takes new work: active, alive with a fresh heartbeat, not draining, reachable."""
    cap = site.capacity
    return (site.state == "active" and site.alive and cap is not None and not cap.draining
            and site.heartbeat_age_s is not None and site.heartbeat_age_s <= cost.heartbeat_max_age_s
            and bool(site.grpc_address))


def servable_models(snapshot: Snapshot, cost: CostModel, allowed_regions: frozenset[str] = frozenset()) -> list[str]:
    """The models live sites in the allowed regions (empty: all) can serve, sorted: some site
    prefills each and some site decodes it. Free capacity does not matter here: a model whose
    sites are full is still served (503 and retry), one missing from this list is not (404)."""
    prefill, decode = set(), set()
    for site in snapshot.sites:
        if not is_live(site, cost) or (allowed_regions and site.region not in allowed_regions):
            continue
        prefill.update(m for m in site.models if site.serves(m, "prefill"))
        decode.update(m for m in site.models if site.serves(m, "decode"))
    return sorted(prefill & decode)


def _usable(site: Site, request: PlacementRequest, cost: CostModel) -> bool:
    return is_live(site, cost) and (not request.allowed_regions or site.region in request.allowed_regions)


def _free_blocks(cap: SnapshotCapacity, load: PendingLoad) -> int:
    return cap.kv_blocks_free - math.ceil(load.kv_tokens / cap.block_size)


def _fits_prefill(site: Site, load: PendingLoad, request: PlacementRequest, num_cached_tokens: int) -> bool:
    cap = site.capacity
    return math.ceil((len(request.prompt_ids) - num_cached_tokens) / cap.block_size) + 1 <= _free_blocks(cap, load)


def _fits_decode(site: Site, load: PendingLoad, request: PlacementRequest, horizon: int) -> bool:
    cap = site.capacity
    return math.ceil((len(request.prompt_ids) + horizon) / cap.block_size) <= _free_blocks(cap, load)


def _site_cost(site: Site, load: PendingLoad, snapshot: Snapshot, request: PlacementRequest, cost: CostModel,
               horizon: int, kv_bytes_per_token: int, hashes_by_block_size: dict[int, list[int]]) -> _SiteCost:
    cap = site.capacity
    client_rtt = _client_rtt_ms(site, snapshot, request, cost)
    num_cached = _cached_tokens(request.prompt_ids, cap.cache_block_size, cap.cached_hashes, hashes_by_block_size)
    num_prompt = len(request.prompt_ids)
    ttft = client_rtt + prefill_queue_ms(cap, load, cost) + prefill_ms(cap, num_prompt - num_cached, cost)
    tpot = decode_step_ms(cap, load, num_prompt + horizon // 2, horizon, kv_bytes_per_token, cost)
    return _SiteCost(site, client_rtt, ttft, tpot, num_cached)


def prefill_queue_ms(cap: SnapshotCapacity, load: PendingLoad, cost: CostModel) -> float:
    """Prefill work ahead of this request: what the site reported plus what this router sent since."""
    return 1000.0 * (cap.inflight_prefill_tokens + load.prefill_tokens) / _prefill_rate(cap, cost)


def prefill_ms(cap: SnapshotCapacity, num_uncached_tokens: int, cost: CostModel) -> float:
    return 1000.0 * num_uncached_tokens / _prefill_rate(cap, cost)


def _prefill_rate(cap: SnapshotCapacity, cost: CostModel) -> float:
    return cap.prefill_tokens_per_s or cost.default_prefill_tokens_per_s


def decode_step_ms(cap: SnapshotCapacity, load: PendingLoad, num_context_tokens: int, horizon: int,
                   kv_bytes_per_token: int, cost: CostModel) -> float:
    """One decode step on the site with this request in the batch: its time per output token."""
    num_running = cap.num_running + load.num_seqs
    kv_tokens = kv_tokens_in_use(cap) + load.kv_tokens
    decode_tokens = cap.inflight_decode_tokens + load.decode_tokens
    # The batch this request decodes beside, on average over its horizon: sequences finish as the
    # site's in-flight decode tokens run out. An agent that reports none is taken to keep them all.
    staying = min(num_running, decode_tokens / horizon) if decode_tokens > 0 else num_running
    kv_staying = kv_tokens * staying / num_running if num_running else 0.0
    work = _step_work(staying + 1, kv_staying + num_context_tokens, kv_bytes_per_token, cost)
    return _work_unit_ms(cap, kv_bytes_per_token, cost) * work


def kv_tokens_in_use(cap: SnapshotCapacity) -> int:
    """KV the site's sequences hold now: what its decode steps read."""
    return max(0, cap.kv_blocks_total - cap.kv_blocks_free) * cap.block_size


def _step_work(num_seqs: float, kv_tokens: float, kv_bytes_per_token: int, cost: CostModel) -> float:
    """A decode step's work in sequences' worth: its fixed part, its sequences, the KV they read."""
    return cost.decode_step_fixed + num_seqs + kv_tokens * kv_bytes_per_token / cost.decode_seq_kv_bytes


def _work_unit_ms(cap: SnapshotCapacity, kv_bytes_per_token: int, cost: CostModel) -> float:
    """Milliseconds per unit of step work, from the decode rate the site measured.

    The rate (tokens per second of decoding) was measured under about the load the site reports:
    b₀ running sequences each get one token per step, so a step took b₀ ÷ rate. An idle site
    reports no load to pair its rate with; it is read as the rate of one sequence alone.
    """
    rate = cap.decode_tokens_per_s or cost.default_decode_tokens_per_s
    num_running = cap.num_running if cap.decode_tokens_per_s else 0
    if num_running == 0:
        return 1000.0 / rate / _step_work(1, 0, kv_bytes_per_token, cost)
    step_ms = 1000.0 * num_running / rate
    return step_ms / _step_work(num_running, kv_tokens_in_use(cap), kv_bytes_per_token, cost)


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


def _apply_session(candidates: list[Candidate], request: PlacementRequest, cost: CostModel, cooling) -> None:
    if not candidates or _touches(candidates[0], cooling):
        return
    best_ms = candidates[0].score_ms
    if request.session_pair is not None:
        for i, candidate in enumerate(candidates):
            if candidate.site_names == request.session_pair:
                if candidate.score_ms <= best_ms * (1.0 + cost.session_margin) + 1.0 and not _touches(candidate, cooling):
                    candidates.insert(0, candidates.pop(i))
                    return
                break  # its pair is now too costly (or cooling): the session moves
    limit = best_ms * (1.0 + cost.affinity_slack) + 1.0
    near = [i for i, c in enumerate(candidates) if c.score_ms <= limit and not _touches(c, cooling)]
    chosen = max(near, key=lambda i: _rendezvous(request.session_key, candidates[i]))
    candidates.insert(0, candidates.pop(chosen))


def _touches(candidate: Candidate, sites: frozenset[str] | set[str]) -> bool:
    return candidate.prefill_site.name in sites or candidate.decode_site.name in sites


def _rendezvous(session_key: str, candidate: Candidate) -> int:
    text = f"{session_key}\x00{candidate.prefill_site.name}\x00{candidate.decode_site.name}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
