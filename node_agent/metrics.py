"""Prometheus metrics of one agent, on its own CollectorRegistry (two agents can share a process).

Engine gauges are refreshed from `stats()` when scraped, so they are never stale; latencies and
byte counts are recorded where they happen. `node_agent.metrics_server` serves them on the metrics
port (HTTPS with `metrics_tls`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from engine.step_totals import StepTotals

if TYPE_CHECKING:  # the metrics (and the Grafana dashboard's test) need no torch
    from engine.engine import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Inter-token gaps are a few ms on a CPU and 10-50 ms on a GPU: buckets fine enough there that a p90 read
# off the histogram (benchmarks/disaggregation.py, a dashboard) is within a millisecond or two.
INTER_TOKEN_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04,
                       0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_running = Gauge("edgefire_agent_running_requests", "Sequences decoding", ["model"], registry=r)
        self.num_waiting = Gauge("edgefire_agent_waiting_requests", "Sequences queued", ["model"], registry=r)
        self.kv_blocks_used = Gauge("edgefire_agent_kv_blocks_used", "KV blocks in use", ["model"], registry=r)
        self.kv_blocks_free = Gauge("edgefire_agent_kv_blocks_free", "KV blocks free or evictable", ["model"], registry=r)
        self.kv_usage = Gauge("edgefire_agent_kv_usage_ratio", "Share of the model's KV pool in use (0-1)", ["model"],
                              registry=r)
        self.kv_leases = Gauge("edgefire_agent_kv_leases", "KV handles pinned awaiting fetch", ["model"], registry=r)
        self.prefix_hit_tokens = Gauge("edgefire_agent_prefix_cache_hit_tokens",
                                       "Prompt tokens served from the prefix cache since start", ["model"], registry=r)
        self.prompt_tokens = Counter("edgefire_agent_prompt_tokens", "Prompt tokens of requests this site "
                                     "prefilled (a decode that imported its KV has none)", ["model"], registry=r)
        self.cached_prompt_tokens = Counter("edgefire_agent_cached_prompt_tokens", "Of those, tokens served from "
                                            "the prefix cache", ["model"], registry=r)
        self.prefix_hit_ratio = Gauge("edgefire_agent_prefix_cache_hit_ratio", "Cached share of the prompt tokens "
                                      "prefilled since start (0-1)", ["model"], registry=r)
        self.prefill_rate = Gauge("edgefire_agent_prefill_tokens_per_second", "Measured prefill rate", ["model"], registry=r)
        self.decode_rate = Gauge("edgefire_agent_decode_tokens_per_second", "Measured decode rate", ["model"], registry=r)
        self.ttft = Histogram("edgefire_agent_ttft_seconds", "Time to first token", ["model", "rpc"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("edgefire_agent_inter_token_seconds", "Time between streamed tokens", ["model"],
                                     buckets=INTER_TOKEN_BUCKETS, registry=r)
        self.kv_bytes_sent = Counter("edgefire_agent_kv_bytes_sent", "KV bytes sent by FetchKV", registry=r)
        self.kv_bytes_received = Counter("edgefire_agent_kv_bytes_received", "KV bytes pulled from peers", registry=r)
        self.kv_pull_bytes = Counter("edgefire_agent_kv_pull_bytes", "KV bytes pulled, by the peer site they came "
                                     "from", ["peer"], registry=r)
        self.kv_pull_seconds = Counter("edgefire_agent_kv_pull_seconds", "Seconds spent pulling KV, by peer site "
                                       "(bytes / seconds: the throughput)", ["peer"], registry=r)
        self.kv_pulls = Counter("edgefire_agent_kv_pulls", "KV pulls completed, by peer site and transport "
                                "(data_port or grpc)", ["peer", "transport"], registry=r)
        self.kv_fallbacks = Counter("edgefire_agent_kv_transfer_fallbacks", "KV pulls that failed and were recomputed",
                                    registry=r)
        self.rejected = Counter("edgefire_agent_rejected_requests", "Requests refused at admission", ["reason"],
                                registry=r)
        self.link_rtt = Gauge("edgefire_agent_link_rtt_milliseconds", "Measured round trip to a peer site",
                              ["peer"], registry=r)
        self.link_bandwidth = Gauge("edgefire_agent_link_bandwidth_mbps", "Measured throughput from a peer site",
                                    ["peer"], registry=r)
        self._link_peers: set[str] = set()  # the peers whose link series are exported
        self.accepted_calls = Counter("edgefire_agent_accepted_calls", "Calls (gRPC) and connections (the KV data "
                                      "port) whose token was accepted, by port, the token's role (router: an agent "
                                      "token digest; peer: a peer token) and credential, the first 8 hex digits of "
                                      "the token's SHA-256: an old token unused during a rotation stops growing",
                                      ["port", "role", "credential"], registry=r)
        self.refused_calls = Counter("edgefire_agent_refused_calls", "Calls and KV data connections refused for "
                                     "their token, by port and reason (unauthenticated: no token or one not "
                                     "accepted; permission_denied: a token of the other role)", ["port", "reason"],
                                     registry=r)
        self.active_role = Gauge("edgefire_agent_active_role", "1 for each role this site takes new work for",
                                 ["role"], registry=r)
        # Routers' Session streams (node_agent.service.SessionRelay): with the token counters, messages tell
        # how many tokens one message carries (a per-request stream sends one message per token and request)
        self.embeddings = Counter("edgefire_agent_embeddings", "Inputs embedded (Embed calls' vectors returned)",
                                  ["model"], registry=r)
        self.sessions_open = Gauge("edgefire_agent_sessions_open", "Session streams open from routers", registry=r)
        self.session_messages = Counter("edgefire_agent_session_messages", "Messages written on Session streams "
                                        "(one per wake-up: every open request's tokens of an engine step)",
                                        registry=r)
        self.session_requests = Counter("edgefire_agent_session_requests", "Requests opened over Session "
                                        "streams, by rpc (generate or decode)", ["rpc"], registry=r)
        self._prompt_totals: dict[str, list[int]] = {}  # model -> [prompt tokens, cached tokens]: the hit ratio
        self._step_totals: dict[str, StepTotals] = {}
        r.register(StepTotalsCollector(self._step_totals))
        self._speculation: dict[str, tuple[int, int, int]] = {}  # model -> proposed, kept, verifications
        r.register(SpeculationCollector(self._speculation))
        self.spec_acceptance = Gauge("edgefire_agent_speculative_acceptance_ratio", "Share of the speculative "
                                     "proposals the model kept since start (0-1; 0 before any)", ["model"], registry=r)

    def observe_stats(self, model: str, stats: EngineStats) -> None:
        self.num_running.labels(model).set(stats.num_running)
        self.num_waiting.labels(model).set(stats.num_waiting)
        self.kv_blocks_used.labels(model).set(stats.num_blocks_total - stats.num_blocks_free)
        self.kv_blocks_free.labels(model).set(stats.num_blocks_free)
        self.kv_usage.labels(model).set(1 - stats.num_blocks_free / max(1, stats.num_blocks_total))
        self.kv_leases.labels(model).set(stats.num_pinned_handles)
        self.prefix_hit_tokens.labels(model).set(stats.prefix_cache_hit_tokens)
        self.prefill_rate.labels(model).set(stats.prefill_tokens_per_s)
        self.decode_rate.labels(model).set(stats.decode_tokens_per_s)
        self._step_totals[model] = stats.steps
        if stats.num_draft_tokens:
            self._speculation[model] = (stats.num_draft_tokens, stats.num_accepted_draft_tokens,
                                        stats.num_speculative_verifications)
            self.spec_acceptance.labels(model).set(stats.num_accepted_draft_tokens / stats.num_draft_tokens)

    def observe_prompt(self, model: str, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """One request's prefill: how much of its prompt the prefix cache held."""
        self.prompt_tokens.labels(model).inc(num_prompt_tokens)
        self.cached_prompt_tokens.labels(model).inc(num_cached_tokens)
        totals = self._prompt_totals.setdefault(model, [0, 0])
        totals[0] += num_prompt_tokens
        totals[1] += num_cached_tokens
        self.prefix_hit_ratio.labels(model).set(totals[1] / max(1, totals[0]))

    def observe_pull(self, peer: str, transport: str, num_bytes: int, seconds: float) -> None:
        self.kv_pull_bytes.labels(peer).inc(num_bytes)
        self.kv_pull_seconds.labels(peer).inc(seconds)
        self.kv_pulls.labels(peer, transport).inc()

    def observe_links(self, links: dict) -> None:
        """links: peer site -> node_agent.links.PeerLink; a peer no longer among them loses its series."""
        for peer in self._link_peers - set(links):
            for gauge in (self.link_rtt, self.link_bandwidth):
                try:
                    gauge.remove(peer)
                except KeyError:  # only one of its figures was ever known
                    pass
        self._link_peers = set(links)
        for peer, link in links.items():
            if link.rtt_ms is not None:
                self.link_rtt.labels(peer).set(link.rtt_ms)
            if link.bandwidth_mbps is not None:
                self.link_bandwidth.labels(peer).set(link.bandwidth_mbps)

    def observe_accepted(self, port: str, role: str, credential: str) -> None:
        """A call or KV data connection opened by an accepted token (node_agent.auth)."""
        self.accepted_calls.labels(port, role, credential).inc()

    def observe_refused(self, port: str, reason: str) -> None:
        self.refused_calls.labels(port, reason).inc()

    def observe_role(self, role: str) -> None:
        for name in ("prefill", "decode"):
            self.active_role.labels(name).set(1 if role in (name, "both") else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StepTotalsCollector:
    """The engines' step totals (engine.step_totals) as counters, labelled by the kind of step:
    `prefill` steps carried prompt tokens (a chunk or a whole prompt), `decode` steps did not."""

    def __init__(self, totals: dict[str, StepTotals]):
        self._totals = totals

    def collect(self):
        labels = ["model", "kind"]
        steps = CounterMetricFamily("edgefire_agent_engine_steps", "Engine steps", labels=labels)
        seconds = CounterMetricFamily("edgefire_agent_engine_step_seconds", "Time in the model and sampler",
                                      labels=labels)
        decoded = CounterMetricFamily("edgefire_agent_engine_decode_tokens",
                                      "Tokens decoded (one inter-token gap each), by the kind of step", labels=labels)
        prefilled = CounterMetricFamily("edgefire_agent_engine_prefill_tokens", "Prompt tokens prefilled",
                                        labels=["model"])
        for model, t in list(self._totals.items()):
            steps.add_metric([model, "prefill"], t.num_prefill_steps)
            steps.add_metric([model, "decode"], t.num_decode_steps)
            seconds.add_metric([model, "prefill"], t.prefill_step_seconds)
            seconds.add_metric([model, "decode"], t.decode_step_seconds)
            decoded.add_metric([model, "prefill"], t.num_decode_tokens_in_prefill_steps)
            decoded.add_metric([model, "decode"], t.num_decode_tokens - t.num_decode_tokens_in_prefill_steps)
            prefilled.add_metric([model], t.num_prefill_tokens)
        yield from (steps, seconds, decoded, prefilled)


class SpeculationCollector:
    """Speculative decoding's counts (engine.speculative) as counters: proposals the model verified,
    those it kept, and the sequence-steps that verified any (kept / verifications + 1: tokens per such step)."""

    def __init__(self, counts: dict[str, tuple[int, int, int]]):
        self._counts = counts

    def collect(self):
        proposed = CounterMetricFamily("edgefire_agent_speculative_draft_tokens",
                                       "Speculative tokens proposed and verified by the model", labels=["model"])
        accepted = CounterMetricFamily("edgefire_agent_speculative_accepted_tokens",
                                       "Of those, tokens the model kept", labels=["model"])
        verified = CounterMetricFamily("edgefire_agent_speculative_verifications",
                                       "Sequence-steps that verified speculative tokens", labels=["model"])
        for model, (num_proposed, num_accepted, num_verifications) in list(self._counts.items()):
            proposed.add_metric([model], num_proposed)
            accepted.add_metric([model], num_accepted)
            verified.add_metric([model], num_verifications)
        yield from (proposed, accepted, verified)
