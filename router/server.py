"""`Router`: one router's parts wired together, with async start/stop, in-process or serving HTTP.

    async with Router(config) as router:       # snapshot feed running, metrics port open (metrics_listen)
        url = await router.start_server()      # uvicorn on config.host:config.port (0: any free port)
        ...
Tests pass `registry=` (a RegistryClient on an in-process registry) and `clock=`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket

import grpc
import uvicorn

from node_agent.client import AgentPool
from node_agent.metrics_server import MetricsServer
from node_agent.tls import channel_credentials, client_context, server_context
from registry.client import RegistryClient
from registry.http_head import HeadLimitedHttp
from router.api_keys import ANONYMOUS, ApiKey, ApiKeyCache, bearer_token
from router.app import create_app
from router.completions import CompletionService, Limits
from router.config import RouterConfig
from router.generation import FailoverPolicy
from router.geo import ClientLocator
from router.health import PassiveHealth
from router.metrics import RouterMetrics
from router.model_assets import ModelAssetsCache
from router.placement import CostModel
from router.placement_report import PlacementReporter
from router.fleet_reporter import FleetReporter, UsageMeter
from router.rate_limit import RateLimiter
from router.sessions import SessionTable
from router.site_checks import SiteChecks
from router.snapshot_feed import SnapshotFeed

log = logging.getLogger(__name__)


class Router:
    def __init__(self, config: RouterConfig, registry: RegistryClient | None = None) -> None:
        self.config = config
        # First: a GeoIP database that cannot place clients (GeoDatabaseError) stops the start before
        # anything else is opened.
        self.locator = ClientLocator(config.lat, config.lon, config.geoip_db, config.location_header,
                                     config.forwarded_for_header, config.trusted_proxies)
        self._owns_registry = registry is None
        self.registry = registry or RegistryClient(config.registry_url, config.registry_token,
                                                   verify=client_context(config.tls_ca) if config.tls_ca else True)
        if config.peer_token:
            log.warning("router: peer_token is the old name of agent_token; rename it (agents split by role "
                        "refuse their peer token from routers: deploy/README.md, Tokens)")
        self.metrics = RouterMetrics()
        self.agents = AgentPool(config.agent_credential, agent_credentials(config), sessions=config.agent_sessions,
                                observer=self.metrics)
        self.metrics.follow_sessions(self.agents)
        self.feed = SnapshotFeed(self.metrics.counting_errors("snapshot", self.registry.snapshot),
                                 config.snapshot_refresh_s, config.snapshot_max_age_s,
                                 SiteChecks(self._check_health, config.site_check_interval_s))
        self.metrics.follow(self.feed)
        self.keys = ApiKeyCache(self.metrics.counting_errors("api_key_lookup", self.registry.lookup_api_key),
                                config.api_key_cache_s)
        self.health = PassiveHealth(config.failures_to_cool_down, config.cooldown_s)
        # Usage and rate-limit charges go to the registry in a report about every second; its answer
        # brings this router's share of each key's limits (router/rate_limit.py, registry/allowance.py).
        self.fleet = FleetReporter(self.metrics.counting_errors("fleet_report", self.registry.fleet_report),
                                   RateLimiter(report_interval_s=config.report_interval_s), UsageMeter(), config.name,
                                   config.report_interval_s, on_revoked=self.keys.forget)
        self.metrics.follow_rate_limits(self.fleet.limiter)
        self.service = CompletionService(
            self.feed, ModelAssetsCache(self.agents, config.retry_after_s, config.reasoning_parsers,
                                         config.tool_call_parsers), self.agents, self.health, self.fleet,
            cost_model(config), failover_policy(config),
            Limits(config.max_prompt_tokens, config.default_max_tokens, config.retry_after_s, config.site,
                   config.max_choices),
            SessionTable(config.max_sessions, config.session_ttl_s), self.metrics)
        self.app = create_app(self)
        self._server: uvicorn.Server | None = None
        self._server_task: asyncio.Task | None = None
        self._metrics_server: MetricsServer | None = None
        self.metrics_port: int | None = None
        self.placement_reporter = (PlacementReporter(self.registry.report_placements, self.metrics,
                                                     config.placement_report_interval_s)
                                   if config.placement_report_interval_s > 0 else None)

    async def _check_health(self, address: str, timeout_s: float):
        return await self.agents.client(address).health(timeout=timeout_s)

    async def authenticate(self, authorization: str | None) -> ApiKey:
        secret = bearer_token(authorization)
        if not self.config.require_api_key and not secret:
            return ANONYMOUS
        return await self.keys.authenticate(secret)

    async def start(self) -> None:
        await self.feed.start()
        self.fleet.start()
        if self.placement_reporter is not None:
            self.placement_reporter.start()
        if self.config.metrics_listen:
            self._metrics_server = MetricsServer(self.metrics.registry)
            tls = server_context(self.config.tls_cert, self.config.tls_key) if self.config.metrics_tls else None
            await self._metrics_server.start(self.config.metrics_listen, tls)
            self.metrics_port = self._metrics_server.port

    async def start_server(self, host: str | None = None, port: int | None = None) -> str:
        """Serves HTTP (HTTPS with tls_cert) in this event loop; returns the base URL (port 0 picks a free one)."""
        sock = socket.socket(socket.AF_INET6 if ":" in (host or self.config.host) else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host or self.config.host, self.config.port if port is None else port))
        sock.listen(2048)
        # proxy_headers off: which peers may say where a client is is `trusted_proxies`' alone (router/geo.py).
        # Uvicorn's own handling believed X-Forwarded-For from any local peer (or FORWARDED_ALLOW_IPS),
        # whatever trusted_proxies said, and rewrote the peer the router then judged.
        config = uvicorn.Config(self.app, http=HeadLimitedHttp, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30, backlog=2048, ssl_certfile=self.config.tls_cert,
                                ssl_keyfile=self.config.tls_key, proxy_headers=False)
        self._server = uvicorn.Server(config)
        self._server_task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._server_task.done():
                await self._server_task  # surfaces the start failure
                raise RuntimeError("the HTTP server stopped during start")
            await asyncio.sleep(0.01)
        # Everything loaded by now (FastAPI, protobuf, tokenizer assets' Python side) lives as long as
        # the process; frozen, the cyclic collector stops rescanning it (a full pass took ~14 ms).
        gc.freeze()
        bound_host, bound_port = sock.getsockname()[:2]
        return f"{'https' if self.config.tls_cert else 'http'}://{bound_host}:{bound_port}"

    async def serve_forever(self) -> None:
        if self._server_task is not None:
            await self._server_task

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.gather(self._server_task, return_exceptions=True)
            self._server = self._server_task = None
        if self._metrics_server is not None:
            await self._metrics_server.stop()
            self._metrics_server = None
        if self.placement_reporter is not None:
            await self.placement_reporter.stop()
        await self.feed.stop()
        await self.fleet.stop()   # after the server: requests that finished while it stopped are reported too
        await self.agents.close()
        self.locator.close()
        if self._owns_registry:
            await self.registry.aclose()

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(self, *_exc) -> None:
        await self.stop()


def agent_credentials(config: RouterConfig) -> grpc.ChannelCredentials | None:
    if not config.agent_tls:
        return None
    return channel_credentials(config.tls_ca, config.agent_client_cert, config.agent_client_key)


def cost_model(config: RouterConfig) -> CostModel:
    return CostModel(
        expected_output_tokens=config.expected_output_tokens,
        default_prefill_tokens_per_s=config.default_prefill_tokens_per_s,
        default_decode_tokens_per_s=config.default_decode_tokens_per_s,
        kv_bytes_per_token=config.default_kv_bytes_per_token, decode_step_fixed=config.decode_step_fixed,
        decode_seq_kv_bytes=config.decode_seq_kv_bytes, heartbeat_max_age_s=config.heartbeat_max_age_s,
        recently_served_s=config.recently_served_s,
        affinity_slack=config.affinity_slack, session_margin=config.session_margin,
        link_max_age_s=config.link_max_age_s, allow_split=config.allow_split)


def failover_policy(config: RouterConfig) -> FailoverPolicy:
    return FailoverPolicy(config.max_attempts, config.first_token_timeout_s, config.token_idle_timeout_s,
                          config.request_timeout_s, config.max_full_wait_s)
