"""Prometheus metrics of one router, on its own CollectorRegistry (several routers can share a process).

Served on the router's metrics port (`metrics_listen`, node_agent.metrics_server), never on its
public port: the OpenAI endpoint faces clients, the metrics port an internal network.

What is counted where:
- requests by model, route (chat, completions, responses, embeddings) and HTTP status, when the status is known
  (the stream's start for SSE);
  `model` is the request's model only when a site in the snapshot lists it, else "unknown", so
  clients cannot grow the label set by sending made-up names;
- placements (split or colocated, the pair that produced the first token, the decode site's
  region), failovers (a request moved on before its first token) and resumes (a stream moved to
  another decode site after tokens were sent), and site failures, by reason;
- latencies as the client sees them: time to first token from the request's arrival, the gap
  between streamed chunks, and the whole request; tokens in, out and served from prefix caches;
- rate-limit rejections, registry errors by operation, the snapshot's age and its live sites, and
  failed snapshot refreshes by reason (router.snapshot_feed: unreachable, unauthorized, error_status,
  bad_encoding, feed_error), read from the feed at each scrape;
- the agent Session streams (node_agent.client) by site: those open, read from the agent pool at each
  scrape, those that broke with requests open, and requests sent per request because the agent has no
  Session RPC (a rollout with older agents shows there). `site` is the snapshot's name for the agent's
  address ("unknown" for an address no site in it has).

The hot path stays cheap: each label set's child is looked up once per request (`ModelMetrics`),
every label set is bounded (models the snapshot lists, sites, gRPC status names), and the only
locks taken are prometheus-client's own.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from registry.client import RegistryError
from router.errors import ApiError
from router.snapshot_feed import FAILURE_REASONS

UNKNOWN_MODEL = "unknown"
UNKNOWN_SITE = "unknown"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
                20.0, 40.0)
# As fine as the agents' at the low end (a CPU or a fast GPU streams a token every few ms: a first bucket
# at 5 ms put the whole distribution in one or two buckets), and up to the stalls a resume covers.
INTER_TOKEN_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04,
                       0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(slots=True)
class ModelMetrics:
    """One model's children of the per-model metrics, looked up once per request."""

    ttft: Histogram
    inter_token: Histogram
    e2e: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    cached_tokens: Counter
    streams_interrupted: Counter
    tool_calls_dropped: Counter


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("edgefire_router_requests", "Completion requests answered, by model, route and "
                                "HTTP status (a stream counts at its start)", ["model", "route", "status"], registry=r)
        self.requests_running = Gauge("edgefire_router_requests_running", "Completion requests in progress",
                                      registry=r)
        self.streams_interrupted = Counter("edgefire_router_streams_interrupted",
                                           "Streams that broke for good after their first byte", ["model"],
                                           registry=r)
        self.placements = Counter("edgefire_router_placements", "Requests placed, by kind (split or colocated), "
                                  "the pair that produced the first token and the decode site's region",
                                  ["kind", "prefill_site", "decode_site", "region"], registry=r)
        self.failovers = Counter("edgefire_router_failovers", "Requests moved to another candidate before their "
                                 "first token, by the reason the previous site failed", ["reason"], registry=r)
        self.resumes = Counter("edgefire_router_resumes", "Streams resumed on another decode site after tokens "
                               "were sent, by the reason the previous site failed", ["reason"], registry=r)
        self.site_failures = Counter("edgefire_router_site_failures", "Attempts a site failed, by site and reason",
                                     ["site", "reason"], registry=r)
        self.ttft = Histogram("edgefire_router_time_to_first_token_seconds", "From the request's arrival to its "
                              "first token, as the client sees it", ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.inter_token = Histogram("edgefire_router_inter_token_latency_seconds", "Time between the chunks "
                                     "of a response", ["model"], buckets=INTER_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("edgefire_router_e2e_request_latency_seconds", "From the request's arrival to its "
                             "last token", ["model"], buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("edgefire_router_prompt_tokens", "Prompt tokens of placed requests",
                                     ["model"], registry=r)
        self.generation_tokens = Counter("edgefire_router_generation_tokens", "Tokens generated and sent",
                                         ["model"], registry=r)
        self.cached_tokens = Counter("edgefire_router_cached_prompt_tokens", "Prompt tokens served from a site's "
                                     "prefix cache", ["model"], registry=r)
        self.tool_calls_dropped = Counter("edgefire_router_tool_calls_dropped", "Tool calls of functions the "
                                          "request did not offer, left out of answers that hold other calls "
                                          "(router/tool_calls.py)", ["model"], registry=r)
        self.rate_limited = Counter("edgefire_router_rate_limited_requests", "Requests refused with 429, by the "
                                    "limit reached", ["limit"], registry=r)
        self.registry_errors = Counter("edgefire_router_registry_errors", "Registry calls that failed, by "
                                       "operation", ["operation"], registry=r)
        self.snapshot_age = Gauge("edgefire_router_snapshot_age_seconds", "Age of the registry snapshot placed "
                                  "with (+Inf before the first)", registry=r)
        self.live_sites = Gauge("edgefire_router_live_sites", "Sites alive in the view placed with", registry=r)
        self.rate_limit_local_share = Gauge("edgefire_router_rate_limit_local_share", "1 while keys' limits are "
                                            "held from this router's local share (no answer from the registry "
                                            "for a grant's life), else 0 (router/rate_limit.py)", registry=r)
        self.rate_limit_routers = Gauge("edgefire_router_rate_limit_live_routers", "Routers sharing keys' limits, "
                                        "as the registry last counted them", registry=r)
        self.session_breaks = Counter("edgefire_router_agent_session_breaks", "Session streams to an agent that "
                                      "ended with an error while requests were open on them, by site",
                                      ["site"], registry=r)
        self.per_request_calls = Counter("edgefire_router_agent_per_request_calls", "Requests sent to an agent as "
                                         "calls of their own because it has no Session RPC, by site",
                                         ["site"], registry=r)
        self._models: dict[str, ModelMetrics] = {}
        self._feed = None
        self._agents = None
        r.register(SnapshotFailuresCollector(self))
        r.register(OpenSessionsCollector(self))
        # (prefill site, decode site) -> requests placed since the last report to the registry (the
        # dashboard's arcs, router.placement_report); one dict increment per request
        self.unreported: dict[tuple[str, str], int] = {}

    def follow(self, feed) -> None:
        """The snapshot gauges read `feed` (router.snapshot_feed.SnapshotFeed) at each scrape."""
        self.snapshot_age.set_function(feed.age_s)
        self.live_sites.set_function(lambda: feed.status().live_sites)
        self._feed = feed

    def follow_rate_limits(self, limiter) -> None:
        """The rate-limit gauges read `limiter` (router.rate_limit.RateLimiter) at each scrape."""
        self.rate_limit_local_share.set_function(lambda: float(limiter.local_share))
        self.rate_limit_routers.set_function(lambda: float(limiter.live_routers))

    def follow_sessions(self, agents) -> None:
        """The open-sessions gauge reads `agents` (node_agent.client.AgentPool) at each scrape."""
        self._agents = agents

    def site_label(self, address: str) -> str:
        """The name of the snapshot's site at an agent address; "unknown" when none is there."""
        if self._feed is None:
            return UNKNOWN_SITE
        try:
            snapshot = self._feed.current()
        except ApiError:
            return UNKNOWN_SITE
        names = snapshot.placement_cache.get("metrics.sites")
        if names is None:
            names = snapshot.placement_cache["metrics.sites"] = {site.grpc_address: site.name
                                                                 for site in snapshot.sites}
        return names.get(address, UNKNOWN_SITE)

    # -- agent sessions (a node_agent.client.SessionObserver) ---------------------------------

    def session_broken(self, address: str) -> None:
        self.session_breaks.labels(self.site_label(address)).inc()

    def sent_per_request(self, address: str) -> None:
        self.per_request_calls.labels(self.site_label(address)).inc()

    # -- per request -------------------------------------------------------------------------

    def model_label(self, model: str | None) -> str:
        """`model` when a site in the current snapshot lists it; "unknown" otherwise."""
        if model is None:
            return UNKNOWN_MODEL
        if self._feed is None:
            return model
        try:
            snapshot = self._feed.current()
        except ApiError:
            return UNKNOWN_MODEL
        known = snapshot.placement_cache.get("metrics.models")
        if known is None:
            known = snapshot.placement_cache["metrics.models"] = frozenset(
                m for site in snapshot.sites for m in site.models)
        return model if model in known else UNKNOWN_MODEL

    def for_model(self, model: str) -> ModelMetrics:
        """The per-model children for a model a request was placed for (so a known one)."""
        found = self._models.get(model)
        if found is None:
            found = self._models[model] = ModelMetrics(
                self.ttft.labels(model), self.inter_token.labels(model), self.e2e.labels(model),
                self.prompt_tokens.labels(model), self.generation_tokens.labels(model),
                self.cached_tokens.labels(model), self.streams_interrupted.labels(model),
                self.tool_calls_dropped.labels(model))
        return found

    def answered(self, model: str | None, route: str, status: int) -> None:
        self.requests.labels(self.model_label(model), route, str(status)).inc()

    def placed(self, prefill_site: str, decode_site: str, region: str | None) -> None:
        kind = "colocated" if prefill_site == decode_site else "split"
        self.placements.labels(kind, prefill_site, decode_site, region or "").inc()
        pair = (prefill_site, decode_site)
        self.unreported[pair] = self.unreported.get(pair, 0) + 1

    def moved_on(self, reason: str, resumed: bool) -> None:
        """A request leaves a failed site for the next candidate (a resume when tokens were already sent)."""
        (self.resumes if resumed else self.failovers).labels(reason).inc()

    def site_failed(self, site: str, reason: str) -> None:
        self.site_failures.labels(site, reason).inc()

    # -- registry calls ----------------------------------------------------------------------

    def counting_errors(self, operation: str, call: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
        """`call`, counting each failure (connection error or error answer) as a registry error."""
        counter = self.registry_errors.labels(operation)

        async def counted(*args, **kwargs):
            try:
                return await call(*args, **kwargs)
            except (httpx.HTTPError, RegistryError):
                counter.inc()
                raise
        return counted


class SnapshotFailuresCollector:
    """The followed feed's failed refreshes by reason, every reason present (0 before any, or with no
    feed), so a dashboard shows a flat series rather than none."""

    def __init__(self, metrics: RouterMetrics):
        self._metrics = metrics

    def collect(self):
        feed = self._metrics._feed
        counts = feed.failures_by_reason if feed is not None else {}
        family = CounterMetricFamily("edgefire_router_snapshot_failures", "Registry snapshot refreshes that "
                                     "failed, by reason: unreachable (no answer), unauthorized (401/403: the "
                                     "router's registry_token), error_status (another error answer), "
                                     "bad_encoding (a body that does not decode), feed_error", labels=["reason"])
        for reason in FAILURE_REASONS:
            family.add_metric([reason], counts.get(reason, 0))
        yield family


class OpenSessionsCollector:
    """Session streams open from this router, by site: every site of the snapshot present (0 with none),
    so a site whose sessions ended shows 0 rather than its last value."""

    def __init__(self, metrics: RouterMetrics):
        self._metrics = metrics

    def collect(self):
        metrics = self._metrics
        family = GaugeMetricFamily("edgefire_router_agent_sessions_open", "Session streams open to agents, by "
                                   "site", labels=["site"])
        counts: dict[str, int] = {}
        if metrics._feed is not None:
            try:
                counts = {site.name: 0 for site in metrics._feed.current().sites}
            except ApiError:
                pass
        if metrics._agents is not None:
            for address in metrics._agents.open_sessions():
                site = metrics.site_label(address)
                counts[site] = counts.get(site, 0) + 1
        for site, count in sorted(counts.items()):
            family.add_metric([site], count)
        yield family


def elapsed_s(started: float) -> float:
    """Seconds since a time.perf_counter() reading."""
    return max(0.0, time.perf_counter() - started)
