"""Placement: which site prefills a request and which decodes it. Pure functions over a Snapshot.

Filter. A site can take a role for a request when it serves the model in that role (site roles and
the model's role), is live (`active`, alive with a heartbeat younger than `heartbeat_max_age_s`, not
draining), in a region the API key allows, and has the KV blocks free: the prompt less its cached
prefix blocks that running sequences or KV leases hold there for a prefill site (with the token it
generates, counted as the agent admits it), prompt + the decode horizon for a decode site. A cached
prefix block that is evictable is counted in the site's free blocks already, and reusing it takes it
from them, so it earns no room (registry.wire: "Held and evictable cached blocks"; a summary that does
not say which are held, from an older agent, has them all held); it still saves its prefill time.
A prefill-only request (`prefill_only`: an embedding, which generates nothing) needs no decode
site: its candidates are the sites that may prefill it, each as the pair (site, site) scored by its
ttft, and its whole prompt must fit the free KV (the agent credits no cached prefix to an embedding).
Each model a site hosts has a KV pool and prefix cache of its own: the blocks free and the cached
prefixes are the model's own where the site reports them apart (registry.wire.SnapshotCapacity.own),
the site's otherwise (one model, or an older agent). Load and rates stay the site's: its models
share its devices. The models live sites can serve at all
(`servable_models`) are what the router offers; `model_availability` says why a key cannot use one
(its regions exclude every site that serves it, or those sites are down for now, or none does).

Inputs. Each site's figures are its latest heartbeat plus `pending`: what this router placed there
since that heartbeat (router/ledger.py), so a burst does not see the same idle site twenty times.
The KV placed there counts against the model's own pool where the site reports it apart (only this
model's placements), against the site's pool otherwise (every model's); the load counts site-wide.
KV bytes per token are each site's own (its agent registers them per model, in its engine's KV
dtype), so a model served in bf16 at one site and fp32 at another is priced by each; for a site
that did not report them, the model's figure from an agent's `GetModelInfo`, and only when that is
unknown too, `CostModel.kv_bytes_per_token`. A split pair must share the KV format (dtype, shape,
checkpoint: what the decode engine checks before it imports a payload); two sites that reported
different formats are never paired, since the KV could not move and the decode site would have to
prefill again.

Cost model, in milliseconds (the router sits near its clients, so router↔site ≈ client↔site):
  client_rtt(s)   fresh measured link from the router's own site when present, else from distance
  queue(s)        (in-flight prefill tokens + pending prefill tokens) ÷ prefill rate
  prefill(s)      uncached prompt tokens ÷ prefill rate; cached tokens come from the site's
                  prefix-cache summary (the leading run of prompt block hashes it holds, held
                  or evictable alike: either saves the compute)
  tpot(d)         the time of one decode step on d once this request has joined it:
                    step(b, k) = unit(d) × (step_fixed + b + k × kv_bytes_per_token ÷ seq_kv_bytes)
                  b sequences reading k KV tokens: each sequence costs one unit, a step's fixed
                  cost (weights read once per step) `decode_step_fixed` units, and reading KV
                  one unit per `decode_seq_kv_bytes` bytes. unit(d) is calibrated from the decode
                  rate the site measured and the load it measured it under (the agent reports
                  both: b₀ sequences per step holding k₀ KV tokens, so rate = b₀ ÷ step(b₀, k₀));
                  an agent that does not report the load is taken to have measured under its
                  current one (running sequences, KV blocks in use), and with none, as one
                  sequence alone. This request joins the sequences still decoding over its horizon
                  (running, capped at in-flight decode tokens ÷ horizon, with their share of the
                  KV: running × the measured KV per sequence, else the KV blocks in use) and
                  reads its own prompt + half the horizon.
  transfer(p, d)  link RTT + KV bytes ÷ link bandwidth: the agents' measurement of the pair when
                  fresh (measured at most `link_max_age_s` before the snapshot), else the RTT
                  implied by distance and `default_bandwidth_mbps` (see `kv_transfer_ms`);
                  KV bytes = prompt tokens × the prefill site's KV bytes per token
  ttft            client_rtt(p) + queue(p) + prefill(p)
  colocated(s)    ttft(s) + horizon × tpot(s)
  split(p, d)     ttft(p) + transfer(p, d) + client_rtt(d) + horizon × tpot(d)
where horizon = min(max_tokens, expected_output_tokens). Rates a site has not measured yet take the
configured defaults. Colocation is just the pair (s, s), so a split wins only when its transfer
costs less than what it saves. With `allow_split` off only colocated pairs are candidates (an
operator who wants no KV moving between sites; prefill-only and decode-only sites then get no work).

Only the best `shortlist` prefill sites and decode sites are paired, which keeps ranking linear in
the number of sites. The ranked list is the failover order, its best `max_candidates` pairs; pairs
touching a cooling site (passive health) go last rather than vanishing, so a request still has
somewhere to go.

Sessions. A request with a session key (`x-session-affinity`, else the OpenAI `user` field) whose
router remembers where the session last ran (`session_pair`) stays on that pair while its score is
within `session_margin` (a fraction) of the best; beyond that it moves, so a session follows its
prefix cache but not onto an overloaded site. A session this router does not know yet (new, or
seen by another router) goes, among the candidates within `affinity_slack` of the best, to the
one with the highest rendezvous hash of (session, pair): every router picks the same pair for it
without sharing state.

Speed. A router places every request against the same snapshot for about a second, and a
snapshot may list hundreds of sites, so what depends only on the snapshot (which sites may serve
a model, their figures and decode calibration, locations, fresh links, region masks) is built
once per snapshot, model and cost model, as arrays (`_ModelSites`, kept in
`Snapshot.placement_cache`); a request then costs a few array operations over all sites, a
prefix-cache check of the sites whose summary holds its first block, and `Candidate` objects for
the pairs it returns. The cost functions below take numbers or arrays alike. Measured by
benchmarks/placement_sim.py (300 sites; figures in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from itertools import takewhile
from dataclasses import dataclass, field

import numpy as np

from engine.prefix_hash import ROOT_HASH, block_hash
from router.geometry import UNKNOWN_DISTANCE_RTT_MS, rtt_ms_arrays, rtt_ms_between
from router.snapshot import Site, Snapshot

DEFAULT_BANDWIDTH_MBPS = 1000.0
OWN_SITE_RTT_MS = 0.5  # client RTT to the site the router runs beside
MAX_FIRST_BLOCKS = 4096  # first blocks whose holders a snapshot remembers (then it starts over)


@dataclass(slots=True, frozen=True)
class CostModel:
    expected_output_tokens: int = 128
    default_prefill_tokens_per_s: float = 4000.0
    default_decode_tokens_per_s: float = 500.0
    kv_bytes_per_token: int = 131072   # only for a model whose agents have not said theirs
    # A decode step's cost in units of one sequence's own work: a fixed part (reading the weights once
    # per step for the whole batch), one unit per sequence, and one unit per `decode_seq_kv_bytes` of
    # KV read. On a GPU a unit is about the time to read 512 MiB, so an 8B model's 16 GiB of bf16
    # weights is a fixed part of ~32 units: batching is nearly free until the KV adds up. A
    # compute-bound CPU engine is closer to 1. The agents do not report the split yet (issue 12).
    decode_step_fixed: float = 32.0
    decode_seq_kv_bytes: float = float(512 << 20)
    heartbeat_max_age_s: float = 15.0
    # A model some site served within this long is still the router's to offer: while its sites are
    # stale (a slow registry, every site restarting) requests get 503 + Retry-After, not a 404 that
    # clients take as final. A model no site has served for longer is unknown (404).
    recently_served_s: float = 600.0
    affinity_slack: float = 0.2        # near-equal candidates for a session this router does not know
    session_margin: float = 0.5        # a known session stays while its pair is within 50% of the best
    default_bandwidth_mbps: float = DEFAULT_BANDWIDTH_MBPS
    link_max_age_s: float = 300.0      # older link measurements give way to the distance estimate
    shortlist: int = 8
    allow_split: bool = True
    max_candidates: int = 16           # the failover order's length


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
    prefill_only: bool = False               # generates nothing (an embedding): no decode site, max_tokens unused


@dataclass(slots=True)
class PendingLoad:
    """What this router placed on a site since the heartbeat the snapshot holds (router/ledger.py)."""

    prefill_tokens: int = 0   # uncached prompt tokens to prefill
    num_seqs: int = 0         # sequences that will decode there
    decode_tokens: int = 0    # their output budgets (max_tokens), like the agents' in-flight decode tokens
    kv_tokens: int = 0        # KV they hold once admitted (their prompts), every model's
    model_kv_tokens: dict[str, int] = field(default_factory=dict)  # the same by model, for per-model pools

    def kv_tokens_for(self, model: str, own_pool: bool) -> int:
        """The KV that meets `model`'s pool: its own placements where the site reports that pool
        apart, every model's where the site has one pool."""
        return self.model_kv_tokens.get(model, 0) if own_pool else self.kv_tokens


@dataclass(slots=True)
class Candidate:
    prefill_site: Site
    decode_site: Site
    ttft_ms: float
    tpot_ms: float
    transfer_ms: float
    score_ms: float
    num_cached_tokens: int
    model: str = ""   # what the request asked for (the in-flight ledger keeps KV per site and model)

    @property
    def colocated(self) -> bool:
        return self.prefill_site.name == self.decode_site.name

    @property
    def site_names(self) -> tuple[str, str]:
        return self.prefill_site.name, self.decode_site.name


# -- the cost model: numbers or arrays alike ------------------------------------------------------

def prefill_queue_ms(inflight_prefill_tokens, prefill_rate):
    """Prefill work ahead of this request (reported plus what this router sent since)."""
    return 1000.0 * inflight_prefill_tokens / prefill_rate


def prefill_ms(num_uncached_tokens, prefill_rate):
    return 1000.0 * num_uncached_tokens / prefill_rate


def decode_step_ms(num_running, kv_tokens, inflight_decode_tokens, unit_ms, num_context_tokens, horizon: int,
                   kv_bytes_per_token: int, cost: CostModel):
    """One decode step with this request in the batch: its time per output token.

    The batch it decodes beside, on average over its horizon: sequences finish as the site's
    in-flight decode tokens run out (an agent that reports none is taken to keep them all), and
    they bring their share of the KV in use."""
    staying = np.where(inflight_decode_tokens > 0, np.minimum(num_running, inflight_decode_tokens / horizon),
                       num_running)
    kv_staying = np.where(num_running > 0, kv_tokens * staying / np.maximum(num_running, 1), 0.0)
    return unit_ms * step_work(staying + 1, kv_staying + num_context_tokens, kv_bytes_per_token, cost)


def step_work(num_seqs, kv_tokens, kv_bytes_per_token: int, cost: CostModel):
    """A decode step's work in sequences' worth: its fixed part, its sequences, the KV they read."""
    return cost.decode_step_fixed + num_seqs + kv_tokens * kv_bytes_per_token / cost.decode_seq_kv_bytes


def work_unit_ms(batch_size, kv_tokens, decode_tokens_per_s, kv_bytes_per_token: int, cost: CostModel):
    """Milliseconds per unit of step work, from a decode rate (0: none measured yet) and the load
    it was measured under: batch_size sequences each got one token per step, so a step of
    step_work(batch_size, kv_tokens) took batch_size ÷ rate. With no load to pair it with, the
    rate is read as one sequence's alone."""
    rate = np.where(decode_tokens_per_s > 0, decode_tokens_per_s, cost.default_decode_tokens_per_s)
    lone = 1000.0 / rate / step_work(1, 0, kv_bytes_per_token, cost)
    loaded = 1000.0 * batch_size / rate / step_work(batch_size, kv_tokens, kv_bytes_per_token, cost)
    return np.where((decode_tokens_per_s > 0) & (batch_size > 0), loaded, lone)


def transfer_ms(rtt_ms, bandwidth_mbps, kv_bytes: int):
    """Moving kv_bytes over a link: one round trip plus the bytes at the link's rate."""
    return rtt_ms + 1000.0 * kv_bytes * 8 / (bandwidth_mbps * 1e6)


def link_figures(src: Site, dst: Site, snapshot: Snapshot, cost: CostModel) -> tuple[float, float]:
    """(RTT ms, bandwidth Mbps) between two sites.

    The agents measure each pair (KV pulls, and small probes when idle); a measurement older than
    `link_max_age_s` says little about the path now, so distance and the default bandwidth stand in.
    """
    link = snapshot.link(src.name, dst.name, cost.link_max_age_s)
    if link is not None and link.bandwidth_mbps > 0:
        return link.rtt_ms, link.bandwidth_mbps
    return rtt_ms_between(src.lat, src.lon, dst.lat, dst.lon), cost.default_bandwidth_mbps


def kv_transfer_ms(src: Site, dst: Site, snapshot: Snapshot, kv_bytes: int, cost: CostModel) -> float:
    """Moving `kv_bytes` of KV from src to dst (see `link_figures`)."""
    return transfer_ms(*link_figures(src, dst, snapshot, cost), kv_bytes)


# -- liveness ------------------------------------------------------------------------------------

def is_live(site: Site, cost: CostModel) -> bool:
    """The site takes new work: active, alive with a fresh heartbeat, not draining, reachable."""
    cap = site.capacity
    return (site.state == "active" and site.alive and cap is not None and not cap.draining
            and site.heartbeat_age_s is not None and site.heartbeat_age_s <= cost.heartbeat_max_age_s
            and bool(site.grpc_address))


def served_recently(site: Site, cost: CostModel) -> bool:
    """The site took work lately: active and heard from within `recently_served_s`, live or not now."""
    return (site.state == "active" and site.capacity is not None and site.heartbeat_age_s is not None
            and site.heartbeat_age_s <= cost.recently_served_s)


def servable_models(snapshot: Snapshot, cost: CostModel, allowed_regions: frozenset[str] = frozenset(),
                    recently: bool = False) -> list[str]:
    """The models live sites in the allowed regions (empty: all) can serve, sorted: some site
    prefills each and some site decodes it. Free capacity does not matter here: a model whose
    sites are full is still served (503 and retry), one missing from this list is not (404).
    `recently`: sites that served within `cost.recently_served_s` count too, live now or not."""
    key = ("servable", cost, allowed_regions, recently)
    models = snapshot.placement_cache.get(key)
    if models is None:
        counts = served_recently if recently else is_live
        prefill, decode = set(), set()
        for site in snapshot.sites:
            if not counts(site, cost) or (allowed_regions and site.region not in allowed_regions):
                continue
            prefill.update(m for m in site.models if site.serves(m, "prefill"))
            decode.update(m for m in site.models if site.serves(m, "decode"))
        models = snapshot.placement_cache[key] = sorted(prefill & decode)
    return models


@dataclass(slots=True, frozen=True)
class Availability:
    """Where a model stands for an API key: live in its regions (`live`), served there lately but by no
    live site now (`resting`: a wait), or served only outside them (`outside_regions`: the regions that
    serve it, lately or now); none of these: no site serves it at all."""
    live: bool = False
    resting: bool = False
    outside_regions: tuple[str, ...] = ()


def model_availability(snapshot: Snapshot, cost: CostModel, model: str,
                       allowed_regions: frozenset[str] = frozenset()) -> Availability:
    """Why a key may or may not use a model now: tells a model the key's regions exclude from one that
    does not exist, and both from one whose sites are down for the moment."""
    if model in servable_models(snapshot, cost, allowed_regions):
        return Availability(live=True)
    if model in servable_models(snapshot, cost, allowed_regions, recently=True):
        return Availability(resting=True)
    if allowed_regions and model in servable_models(snapshot, cost, recently=True):
        regions = {site.region or "(no region)" for site in snapshot.sites
                   if model in site.models and served_recently(site, cost)}
        return Availability(outside_regions=tuple(sorted(regions)))
    return Availability()


# -- per snapshot: the sites that may serve a model, as arrays -----------------------------------

@dataclass(slots=True)
class _Summaries:
    # (position, cached block hashes, those of them held by running sequences or leases) of the sites with one
    sites: list[tuple[int, frozenset[int], frozenset[int]]]
    any_site: frozenset[int]                  # every hash any of them holds
    holders: dict[int, list[tuple[int, frozenset[int], frozenset[int]]]] = field(default_factory=dict)  # by first block
    # by a held chain of block hashes: positions of its first block's holders, the blocks each holds from its
    # start, and how many of those are held, of them all and of all but the last
    runs: dict[tuple[int, ...], tuple[np.ndarray, ...]] = field(default_factory=dict)


@dataclass(slots=True)
class _ModelSites:
    sites: list[Site]
    index: dict[str, int]
    regions: list[str | None]
    lat_rad: np.ndarray
    lon_rad: np.ndarray
    cos_lat: np.ndarray
    located: np.ndarray           # has coordinates
    can_prefill: np.ndarray
    can_decode: np.ndarray
    kv_blocks_free: np.ndarray    # in the model's own KV pool where the site reports it apart
    own_pool: np.ndarray          # the site reports the model's KV pool apart (else one pool for all)
    block_size: np.ndarray
    inflight_prefill_tokens: np.ndarray
    prefill_rate: np.ndarray      # measured, else the default
    num_running: np.ndarray
    kv_tokens: np.ndarray         # KV its running sequences hold: what its decode steps read
    inflight_decode_tokens: np.ndarray
    decode_rate: np.ndarray       # measured; 0 when not yet
    rate_batch_size: np.ndarray   # the load it was measured under: sequences per step...
    rate_kv_tokens: np.ndarray    # ...and the KV they held (the current load where not reported)
    kv_bytes_per_token: np.ndarray  # the site's own for the model; 0 where it did not report it
    kv_format: np.ndarray         # the site's KV format as a small integer; 0 where it did not report it
    summaries: dict[int, _Summaries]  # prefix-cache summaries by their block size
    links: dict[tuple[int, int], tuple[float, float]]  # fresh measured (RTT, bandwidth) by position pair
    link_rtt_ms: np.ndarray | None    # the same as [src, dst] matrices (NaN: none), when there are any
    link_bandwidth_mbps: np.ndarray | None
    derived: dict = field(default_factory=dict)  # region masks, client RTT overrides, unit costs


def _model_sites(snapshot: Snapshot, model: str, cost: CostModel) -> _ModelSites | None:
    key = ("sites", model, cost)
    if key not in snapshot.placement_cache:
        snapshot.placement_cache[key] = _build_model_sites(snapshot, model, cost)
    return snapshot.placement_cache[key]


def _build_model_sites(snapshot: Snapshot, model: str, cost: CostModel) -> _ModelSites | None:
    sites = [s for s in snapshot.sites
             if is_live(s, cost) and (s.serves(model, "prefill") or s.serves(model, "decode"))]
    if not sites:
        return None
    caps = [s.capacity for s in sites]
    own = [c.own(model) for c in caps]  # the model's own KV pool and prefix cache where reported apart

    def column(values, dtype=np.float64) -> np.ndarray:
        return np.fromiter(values, dtype, len(sites))

    lat = np.radians(column(s.lat if s.lat is not None else 0.0 for s in sites))
    index = {s.name: i for i, s in enumerate(sites)}
    kv = [s.model_kv.get(model) for s in sites]
    formats: dict[str, int] = {"": 0}
    return _ModelSites(
        sites=sites, index=index, regions=[s.region for s in sites], lat_rad=lat,
        lon_rad=np.radians(column(s.lon if s.lon is not None else 0.0 for s in sites)), cos_lat=np.cos(lat),
        located=column((s.lat is not None and s.lon is not None for s in sites), bool),
        can_prefill=column((s.serves(model, "prefill") for s in sites), bool),
        can_decode=column((s.serves(model, "decode") for s in sites), bool),
        kv_blocks_free=column(o.kv_blocks_free for o in own),
        own_pool=column((o is not c for o, c in zip(own, caps)), bool), block_size=column(c.block_size for c in caps),
        inflight_prefill_tokens=column(c.inflight_prefill_tokens for c in caps),
        prefill_rate=column(c.prefill_tokens_per_s or cost.default_prefill_tokens_per_s for c in caps),
        num_running=column(c.num_running for c in caps),
        kv_tokens=column(_decoding_kv_tokens(c) for c in caps),
        inflight_decode_tokens=column(c.inflight_decode_tokens for c in caps),
        decode_rate=column(c.decode_tokens_per_s for c in caps),
        rate_batch_size=column(c.decode_batch_size or c.num_running for c in caps),
        rate_kv_tokens=column(c.decode_kv_tokens if c.decode_batch_size else _kv_in_use(c) for c in caps),
        kv_bytes_per_token=column(k.bytes_per_token if k else 0 for k in kv),
        kv_format=column((formats.setdefault(k.kv_format if k else "", len(formats)) for k in kv), np.int64),
        summaries=_summaries(own), **_fresh_links(snapshot, sites, index, cost))


def _kv_in_use(cap) -> int:
    return max(0, cap.kv_blocks_total - cap.kv_blocks_free) * cap.block_size


def _decoding_kv_tokens(cap) -> float:
    """KV the site's running sequences hold: what its decode steps read. From the KV per sequence
    its decode steps measured; an agent that does not report it gives its KV blocks in use (which
    also count prefills and KV leases)."""
    if cap.decode_batch_size:
        return cap.num_running * cap.decode_kv_tokens / cap.decode_batch_size
    return _kv_in_use(cap)


def _summaries(caps: list) -> dict[int, _Summaries]:
    """The prefix-cache summaries of the sites (each the model's own, where the site reports it apart)."""
    by_block_size: dict[int, list[tuple[int, frozenset[int], frozenset[int]]]] = {}
    for i, cap in enumerate(caps):
        if cap.cached_hashes and cap.cache_block_size > 0:
            by_block_size.setdefault(cap.cache_block_size, []).append((i, cap.cached_hashes, cap.held_hashes))
    return {block_size: _Summaries(sites, frozenset().union(*(cached for _i, cached, _held in sites)))
            for block_size, sites in by_block_size.items()}


def _fresh_links(snapshot: Snapshot, sites: list[Site], index: dict[str, int], cost: CostModel) -> dict:
    links = {}
    for src, dst in snapshot.links:
        i, j = index.get(src), index.get(dst)
        if i is None or j is None or (i, j) in links:
            continue
        link = snapshot.link(src, dst, cost.link_max_age_s)
        if link is not None and link.bandwidth_mbps > 0:
            links[(i, j)] = links[(j, i)] = link_figures(sites[i], sites[j], snapshot, cost)
    if not links:
        return {"links": links, "link_rtt_ms": None, "link_bandwidth_mbps": None}
    rtt_ms, bandwidth_mbps = np.full((2, len(sites), len(sites)), np.nan)
    pairs = tuple(np.array(list(links)).T)
    rtt_ms[pairs], bandwidth_mbps[pairs] = np.array(list(links.values())).T
    return {"links": links, "link_rtt_ms": rtt_ms, "link_bandwidth_mbps": bandwidth_mbps}


def _derived(sites: _ModelSites, key, build):
    value = sites.derived.get(key)
    if value is None:
        value = sites.derived[key] = build()
    return value


# -- per request ---------------------------------------------------------------------------------

@dataclass(slots=True)
class _SiteCosts:
    client_rtt_ms: np.ndarray
    ttft_ms: np.ndarray
    tpot_ms: np.ndarray
    num_cached_tokens: np.ndarray
    prefill_ok: np.ndarray        # may prefill this request (role, region, room)
    decode_ok: np.ndarray


@dataclass(slots=True)
class _Pairs:
    prefill: np.ndarray           # site positions
    decode: np.ndarray
    transfer_ms: np.ndarray
    score_ms: np.ndarray


def rank(snapshot: Snapshot, request: PlacementRequest, cost: CostModel,
         cooling: frozenset[str] | set[str] = frozenset(),
         pending: Mapping[str, PendingLoad] | None = None) -> list[Candidate]:
    """The best viable (prefill, decode) pairs, best first: the failover order."""
    sites = _model_sites(snapshot, request.model, cost)
    if sites is None:
        return []
    horizon = max(1, min(request.max_tokens, cost.expected_output_tokens))
    model_kv_bytes = request.kv_bytes_per_token or cost.kv_bytes_per_token
    kv_bytes_per_token = _derived(sites, ("kv_bytes_per_token", model_kv_bytes), lambda: np.where(
        sites.kv_bytes_per_token > 0, sites.kv_bytes_per_token, model_kv_bytes))
    costs = _site_costs(sites, request, cost, pending or {}, horizon, model_kv_bytes, kv_bytes_per_token)
    if request.prefill_only:
        alone = np.flatnonzero(costs.prefill_ok)
        pairs = _Pairs(alone, alone, np.zeros(len(alone)), costs.ttft_ms[alone])
    else:
        pairs = _pairs(sites, costs, cost, horizon, len(request.prompt_ids) * kv_bytes_per_token)
    if not len(pairs.score_ms):
        return []
    cooling_sites = np.zeros(len(sites.sites), bool)
    cooling_sites[[sites.index[name] for name in cooling if name in sites.index]] = True
    pair_cooling = cooling_sites[pairs.prefill] | cooling_sites[pairs.decode]
    order = np.lexsort((pairs.score_ms, pair_cooling))
    first = int(order[0])
    if request.session_key and not pair_cooling[first]:
        first = _session_choice(sites, pairs, pair_cooling, first, request, cost)
    chosen = [first] + [i for i in order[:cost.max_candidates].tolist() if i != first][:cost.max_candidates - 1]
    return [_candidate(sites, costs, pairs, i, request.model) for i in chosen]


def _site_costs(sites: _ModelSites, request: PlacementRequest, cost: CostModel, pending: Mapping[str, PendingLoad],
                horizon: int, model_kv_bytes: int, kv_bytes_per_token: np.ndarray) -> _SiteCosts:
    prefill_tokens, num_seqs, decode_tokens, kv_tokens = _pending_arrays(sites, request.model, pending)
    num_prompt = len(request.prompt_ids)
    client_rtt = _client_rtt_ms(sites, request)
    num_cached, num_held = _cached_tokens(sites, request.prompt_ids)
    ttft = (client_rtt + prefill_queue_ms(sites.inflight_prefill_tokens + prefill_tokens, sites.prefill_rate)
            + prefill_ms(num_prompt - num_cached, sites.prefill_rate))
    free_blocks = sites.kv_blocks_free - np.ceil(kv_tokens / sites.block_size)
    allowed = _region_mask(sites, request.allowed_regions)
    generated = 0 if request.prefill_only else 1   # room for the generated token, as the agent admits
    # the agent credits a cached prefix to a generating request only, and only its held blocks (an evictable
    # one is among the free blocks already); an embedding needs room for all its input
    credited = 0 if request.prefill_only else num_held
    prefill_blocks = np.ceil((num_prompt - credited + generated) / sites.block_size)
    prefill_ok = sites.can_prefill & allowed & (prefill_blocks <= free_blocks)
    if request.prefill_only:
        nothing = np.zeros(len(sites.sites))
        return _SiteCosts(client_rtt, ttft, nothing, num_cached, prefill_ok, nothing.astype(bool))
    unit_ms = _derived(sites, ("unit_ms", model_kv_bytes), lambda: work_unit_ms(
        sites.rate_batch_size, sites.rate_kv_tokens, sites.decode_rate, kv_bytes_per_token, cost))
    tpot = decode_step_ms(sites.num_running + num_seqs, sites.kv_tokens + kv_tokens,
                          sites.inflight_decode_tokens + decode_tokens, unit_ms, num_prompt + horizon // 2, horizon,
                          kv_bytes_per_token, cost)
    decode_ok = sites.can_decode & allowed & (np.ceil((num_prompt + horizon) / sites.block_size) <= free_blocks)
    return _SiteCosts(client_rtt, ttft, tpot, num_cached, prefill_ok, decode_ok)


def _pending_arrays(sites: _ModelSites, model: str, pending: Mapping[str, PendingLoad]):
    """(prefill tokens, sequences, decode tokens, KV tokens) this router added per site; zeros when none.
    The KV is what meets `model`'s pool there (PendingLoad.kv_tokens_for)."""
    rows = [(sites.index[name], load) for name, load in pending.items() if name in sites.index]
    if not rows:
        return 0, 0, 0, 0
    arrays = np.zeros((4, len(sites.sites)))
    for i, load in rows:
        arrays[:, i] = (load.prefill_tokens, load.num_seqs, load.decode_tokens,
                        load.kv_tokens_for(model, bool(sites.own_pool[i])))
    return arrays[0], arrays[1], arrays[2], arrays[3]


def _client_rtt_ms(sites: _ModelSites, request: PlacementRequest) -> np.ndarray:
    """From distance, except where the router's own site has a fresh measured link to the site."""
    rtt = rtt_ms_arrays(math.radians(request.client_lat), math.radians(request.client_lon), sites.lat_rad,
                        sites.lon_rad, cos_lat2=sites.cos_lat)
    rtt = np.where(sites.located, rtt, UNKNOWN_DISTANCE_RTT_MS)
    if request.client_site is None:
        return rtt
    measured = _derived(sites, ("client_site", request.client_site), lambda: _measured_from(sites, request.client_site))
    return np.where(np.isnan(measured), rtt, measured)


def _measured_from(sites: _ModelSites, own_site: str) -> np.ndarray:
    measured = np.full(len(sites.sites), np.nan)
    own = sites.index.get(own_site)
    for (i, j), (rtt_ms, _bandwidth) in sites.links.items():
        if i == own:
            measured[j] = rtt_ms
    if own is not None:
        measured[own] = OWN_SITE_RTT_MS
    return measured


def _region_mask(sites: _ModelSites, allowed_regions: frozenset[str]) -> np.ndarray | bool:
    if not allowed_regions:
        return True
    return _derived(sites, ("regions", allowed_regions), lambda: np.fromiter(
        (region in allowed_regions for region in sites.regions), bool, len(sites.regions)))


def _cached_tokens(sites: _ModelSites, prompt_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Prompt tokens each site's prefix cache holds: the leading run of prompt blocks in its summary; and of
    those, the tokens of blocks that running sequences or KV leases hold there (the rest are evictable).

    Only sites holding the prompt's first block count (found once per snapshot for each first
    block: a shared system prompt or a conversation's opening), and blocks are hashed only as deep
    as some site holds the chain, so a prompt no site has seen costs one hash per block size. What
    each holder holds of a held chain (a shared prefix, then the request's own text that no site
    holds) is worked out once per snapshot and chain, not once per request.
    The last prompt token is always recomputed (its logits pick the first output token), and the engine
    reuses whole blocks only: of a prompt of L tokens, at most the (L - 1) // block_size blocks before the
    one holding its last token (engine.block_manager), so a prompt of whole blocks recomputes its last block."""
    num_cached, num_held = np.zeros(len(sites.sites)), np.zeros(len(sites.sites))
    for block_size, summaries in sites.summaries.items():
        if len(prompt_ids) < block_size:
            continue
        hashes = [block_hash(ROOT_HASH, prompt_ids[:block_size])]
        if hashes[0] not in summaries.any_site:
            continue
        end = 2 * block_size
        while end <= len(prompt_ids) and hashes[-1] in summaries.any_site:
            hashes.append(block_hash(hashes[-1], prompt_ids[end - block_size:end]))
            end += block_size
        held = hashes if hashes[-1] in summaries.any_site else hashes[:-1]  # the prompt may end inside a chain
        key = tuple(held)
        runs = summaries.runs.get(key)
        if runs is None:
            if len(summaries.runs) >= MAX_FIRST_BLOCKS:
                summaries.runs.clear()
            holders = _holders(summaries, hashes[0])
            lengths = [_leading_run(held, held[:-1], cached) for _i, cached, _held in holders]
            held_hits = [_held_hits(held, length, cached, held_cached)
                         for length, (_i, cached, held_cached) in zip(lengths, holders)]
            held_all, held_but_last = np.array(held_hits, dtype=float).reshape(-1, 2).T
            runs = summaries.runs[key] = (np.array([i for i, _cached, _held in holders], dtype=np.intp),
                                          np.array(lengths, dtype=float), held_all, held_but_last)
        positions, lengths, held_all, held_but_last = runs
        # the chain ends at the prompt's last whole block, so the cap takes at most one block off a run
        num_blocks = np.minimum(lengths, (len(prompt_ids) - 1) // block_size)
        num_cached[positions] = block_size * num_blocks
        num_held[positions] = block_size * np.where(num_blocks < lengths, held_but_last, held_all)
    return num_cached, num_held


def _holders(summaries: _Summaries, first_block: int) -> list[tuple[int, frozenset[int], frozenset[int]]]:
    """The sites holding a first block, with their summaries (found once per snapshot for each)."""
    holders = summaries.holders.get(first_block)
    if holders is None:
        if len(summaries.holders) >= MAX_FIRST_BLOCKS:
            summaries.holders.clear()
        holders = summaries.holders[first_block] = [site for site in summaries.sites if first_block in site[1]]
    return holders


def _leading_run(hashes: list[int], all_but_last: list[int], cached: frozenset[int]) -> int:
    """How many of hashes, from the first, cached holds. The common cases (all but the block where
    the chain was stopped, or the whole chain) are set operations in C; gaps take the loop."""
    if hashes[-1] not in cached:
        if cached.issuperset(all_but_last):
            return len(all_but_last)
    elif cached.issuperset(hashes):
        return len(hashes)
    return sum(1 for _h in takewhile(cached.__contains__, hashes))


def _held_hits(chain: list[int], length: int, cached: frozenset[int], held: frozenset[int]) -> tuple[int, int]:
    """Of the first `length` blocks of chain (all cached), how many are held, and how many of all but the
    last: set operations in C (`held is cached` where the summary holds every block, or does not say)."""
    if held is cached:
        return length, max(length - 1, 0)
    if not held or not length:
        return 0, 0
    num_held = len(held.intersection(chain[:length]))
    return num_held, num_held - (chain[length - 1] in held)


def _pairs(sites: _ModelSites, costs: _SiteCosts, cost: CostModel, horizon: int, kv_bytes: np.ndarray) -> _Pairs:
    """Colocation on every site that may do both, and the shortlisted split pairs whose KV can move
    (kv_bytes: the prompt's KV at each site)."""
    both = np.flatnonzero(costs.prefill_ok & costs.decode_ok)
    colocated_ms = costs.ttft_ms[both] + horizon * costs.tpot_ms[both]
    if not cost.allow_split:
        return _Pairs(both, both, np.zeros(len(both)), colocated_ms)
    prefill = _shortlist(np.flatnonzero(costs.prefill_ok), costs.ttft_ms, cost.shortlist)
    decode = _shortlist(np.flatnonzero(costs.decode_ok), costs.client_rtt_ms + horizon * costs.tpot_ms,
                        cost.shortlist)
    p, d = np.repeat(prefill, len(decode)), np.tile(decode, len(prefill))
    fp, fd = sites.kv_format[p], sites.kv_format[d]
    movable = (p != d) & ((fp == 0) | (fd == 0) | (fp == fd))
    p, d = p[movable], d[movable]
    rtt_ms, bandwidth_mbps = _link_arrays(sites, p, d, cost)
    transfer = transfer_ms(rtt_ms, bandwidth_mbps, kv_bytes[p])
    split_ms = costs.ttft_ms[p] + transfer + costs.client_rtt_ms[d] + horizon * costs.tpot_ms[d]
    return _Pairs(np.concatenate([both, p]), np.concatenate([both, d]),
                  np.concatenate([np.zeros(len(both)), transfer]), np.concatenate([colocated_ms, split_ms]))


def _shortlist(positions: np.ndarray, key_ms: np.ndarray, size: int) -> np.ndarray:
    return positions[np.argsort(key_ms[positions], kind="stable")[:size]]


def _link_arrays(sites: _ModelSites, src: np.ndarray, dst: np.ndarray, cost: CostModel):
    """`link_figures` for many pairs: measured where fresh, else distance and the default bandwidth."""
    rtt_ms = rtt_ms_arrays(sites.lat_rad[src], sites.lon_rad[src], sites.lat_rad[dst], sites.lon_rad[dst],
                           sites.cos_lat[src], sites.cos_lat[dst])
    rtt_ms = np.where(sites.located[src] & sites.located[dst], rtt_ms, UNKNOWN_DISTANCE_RTT_MS)
    if sites.link_rtt_ms is None:
        return rtt_ms, cost.default_bandwidth_mbps
    measured_rtt_ms, measured_bandwidth_mbps = sites.link_rtt_ms[src, dst], sites.link_bandwidth_mbps[src, dst]
    measured = ~np.isnan(measured_rtt_ms)
    return (np.where(measured, measured_rtt_ms, rtt_ms),
            np.where(measured, measured_bandwidth_mbps, cost.default_bandwidth_mbps))


def _candidate(sites: _ModelSites, costs: _SiteCosts, pairs: _Pairs, i: int, model: str) -> Candidate:
    p, d = int(pairs.prefill[i]), int(pairs.decode[i])
    return Candidate(sites.sites[p], sites.sites[d], float(costs.ttft_ms[p]), float(costs.tpot_ms[d]),
                     float(pairs.transfer_ms[i]), float(pairs.score_ms[i]), int(costs.num_cached_tokens[p]), model)


def _session_choice(sites: _ModelSites, pairs: _Pairs, pair_cooling: np.ndarray, best: int,
                    request: PlacementRequest, cost: CostModel) -> int:
    """The pair a session goes to: its last pair while within the margin, else its rendezvous pick."""
    best_ms = float(pairs.score_ms[best])
    home = _pair_position(sites, pairs, request.session_pair)
    if (home is not None and not pair_cooling[home]
            and pairs.score_ms[home] <= best_ms * (1.0 + cost.session_margin) + 1.0):
        return home
    near = np.flatnonzero((pairs.score_ms <= best_ms * (1.0 + cost.affinity_slack) + 1.0) & ~pair_cooling)
    return int(max(near.tolist(), key=lambda i: _rendezvous(
        request.session_key, sites.sites[pairs.prefill[i]].name, sites.sites[pairs.decode[i]].name)))


def _pair_position(sites: _ModelSites, pairs: _Pairs, names: tuple[str, str] | None) -> int | None:
    if names is None or names[0] not in sites.index or names[1] not in sites.index:
        return None
    found = np.flatnonzero((pairs.prefill == sites.index[names[0]]) & (pairs.decode == sites.index[names[1]]))
    return int(found[0]) if len(found) else None


def _rendezvous(session_key: str, prefill_site: str, decode_site: str) -> int:
    text = f"{session_key}\x00{prefill_site}\x00{decode_site}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
