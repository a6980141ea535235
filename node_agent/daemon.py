"""The agent daemon: wires config, engines, the gRPC server, metrics and heartbeats together.

    agent = Agent(config)
    await agent.start()          # engines loaded, serving, registered
    ...
    await agent.drain()          # refuse new work, finish in-flight, release leases, deregister, stop

Tests and the one-machine launcher run agents in-process through this class; `edgefire agent` runs
one and drains it on SIGTERM.

An engine that stops (its step loop crashed, or a rank of a tensor/pipeline-parallel engine died)
cannot serve again in this process: the agent reports NOT_SERVING and draining at once (routers
move on), deregisters, stops, and sets `exit_code` 1, which `edgefire agent` exits with so that
a supervisor (systemd, Kubernetes) starts a fresh one.

A site the operator deleted (the registry answers a heartbeat or registration 410 `site_deleted`): the
agent logs one line (`site NAME was deleted from the registry at T by ACTOR: draining and stopping`),
refuses new work, finishes what it runs within `drain_timeout_s`, stops without calling the registry
again, and sets `exit_code` SITE_DELETED_EXIT_STATUS (3), which the systemd unit does not restart
(`RestartPreventExitStatus`): a restarted agent would only be refused again. An agent started for a
deleted site is refused at its first registration and exits the same way, having taken no work.
"""

from __future__ import annotations

import asyncio
import logging
import time

from grpc import aio

from node_agent.auth import RoleTokens, TokenAuthInterceptor
from node_agent.client import MESSAGE_OPTIONS
from node_agent.config import AgentConfig
from node_agent.core import AgentCore
from node_agent.errors import ListenError
from node_agent.kv_data import KVDataServer
from node_agent.heartbeat import HeartbeatLoop, ModelFigures, Registration, site_capacity_report
from node_agent.links import LinkLoop, LinkSettings
from node_agent.metrics import AgentMetrics
from node_agent.metrics_server import MetricsServer
from node_agent.models import HostedModel, load_model, served
from node_agent.proto import agent_pb2_grpc
from node_agent.service import AgentServicer
from node_agent.tls import client_context, server_context, server_credentials
from registry.wire import CapacityReport

log = logging.getLogger(__name__)

STOP_GRACE_S = 2.0
ENGINE_WATCH_S = 0.5      # how often the agent checks that its engines still run
FAILED_LINGER_S = 2.0     # after an engine died, Health answers NOT_SERVING this long before the agent exits
SITE_DELETED_EXIT_STATUS = 3  # the registry says the site was deleted; deploy/systemd prevents its restart


class Agent:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.metrics = AgentMetrics()
        self.models: dict[str, HostedModel] = {}
        self.core: AgentCore | None = None
        self.servicer: AgentServicer | None = None
        self.heartbeats: HeartbeatLoop | None = None
        self.link_loop: LinkLoop | None = None
        self._link_stop: asyncio.Task | None = None   # the link reports' end once the site was deleted
        self.address = ""                 # host:port actually bound (grpc_listen may ask for port 0)
        self.metrics_port: int | None = None
        self._server: aio.Server | None = None
        self._metrics_server: MetricsServer | None = None
        self._drain_task: asyncio.Task | None = None
        self._engine_watch: asyncio.Task | None = None
        self._stopped = asyncio.Event()
        self.exit_code = 0                # 1 once an engine died, SITE_DELETED_EXIT_STATUS once the site was deleted
        self.site_deleted = False         # the registry said so: drain, and call it no more

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        self.models = await self._load_models()
        self.core = AgentCore(cfg, self.models, self.metrics)
        self.servicer = AgentServicer(self.core, on_drain=self.request_drain)
        tokens = RoleTokens(cfg.peer_token, cfg.agent_token_digests, cfg.accept_peer_tokens)
        self._warn_about_tokens()
        # Without SO_REUSEPORT (gRPC's default) a second agent given a port in use fails here instead
        # of sharing it and taking half of the first one's requests.
        self._server = aio.server(interceptors=[TokenAuthInterceptor(tokens, self.metrics)],
                                  options=[*MESSAGE_OPTIONS, ("grpc.so_reuseport", 0)])
        agent_pb2_grpc.add_AgentServicer_to_server(self.servicer, self._server)
        try:
            port = self._bind(cfg.grpc_listen)
        except RuntimeError:  # gRPC's "Failed to bind to address"
            raise ListenError(f"grpc_listen {cfg.grpc_listen}: cannot listen there (another process holds the "
                              f"port, or the host is not this machine's)") from None
        self.address = f"{cfg.grpc_listen.rpartition(':')[0]}:{port}"
        await self._server.start()
        if cfg.kv_data_port is not None:
            await self._start_kv_data(cfg.grpc_listen.rpartition(":")[0].strip("[]"), cfg.kv_data_port, tokens)
        if cfg.metrics_listen:
            self._metrics_server = MetricsServer(self.metrics.registry, self.refresh_metrics)
            try:
                await self._metrics_server.start(cfg.metrics_listen,
                                                 server_context(cfg.tls_cert, cfg.tls_key) if cfg.metrics_tls else None)
            except OSError as exc:
                self._metrics_server = None
                raise ListenError(f"metrics_listen {cfg.metrics_listen}: cannot listen there ({exc.strerror})") from None
            self.metrics_port = self._metrics_server.port
        if cfg.registry_url:
            self._start_heartbeats()
        self._engine_watch = asyncio.create_task(self._watch_engines(), name="engine-watch")
        log.info("agent %s serving %s on %s", cfg.site, ", ".join(self.models), self.address)

    async def _load_models(self) -> dict[str, HostedModel]:
        """Every model loaded, or none: when one fails, those that did load are shut down before its error
        is raised (their step threads, and a parallel engine's rank processes, would outlive the agent)."""
        models = self.config.models
        loaded = await asyncio.gather(*(load_model(name, path, self.config) for name, path in models.items()),
                                      return_exceptions=True)
        failure = next((result for result in loaded if isinstance(result, BaseException)), None)
        hosted = [result for result in loaded if isinstance(result, HostedModel)]
        if failure is None:
            return {model.name: model for model in hosted}
        for model in hosted:
            await asyncio.to_thread(model.engine.shutdown)
        raise failure

    def _warn_about_tokens(self) -> None:
        """What the agent accepts beyond one token per role: a fleet from before the split, or a rotation
        under way, which should not outlast it (deploy/README.md, Tokens)."""
        cfg = self.config
        if not cfg.agent_token_digests:
            log.warning("agent %s: agent_token_sha256 is not set, so the peer token also opens the router methods "
                        "(Generate, Prefill, Decode, GetModelInfo, Drain) to every site that holds it; to split them, "
                        "give the routers a token of their own as agent_token and this agent its SHA-256 as "
                        "agent_token_sha256 (deploy/README.md, Tokens)", cfg.site)
        if len(cfg.agent_token_digests) > 1:
            log.warning("agent %s: agent_token_sha256 lists %d agent token digests, all accepted (a rotation of the "
                        "routers' agent_token); once every router presents the new token, keep its digest alone",
                        cfg.site, len(cfg.agent_token_digests))
        if cfg.accept_peer_tokens:
            log.warning("agent %s: accept_peer_tokens: %d peer token(s) accepted beside peer_token (a rotation of the "
                        "peer token); once every peer sends the same peer_token, remove accept_peer_tokens",
                        cfg.site, len(cfg.accept_peer_tokens))

    async def _start_kv_data(self, host: str, port: int, tokens: RoleTokens) -> None:
        core = self.core
        cfg = self.config
        ssl_context = server_context(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls_cert else None
        server = KVDataServer(tokens, core.open_export, core.end_export, core.metrics.kv_bytes_sent.inc,
                              ssl_context, observer=core.metrics)
        try:
            await server.start(host or "0.0.0.0", port)
        except OSError as exc:
            raise ListenError(f"kv_data_port {port}: cannot listen on {host or '0.0.0.0'}:{port} ({exc.strerror})") from None
        core.kv_data_server = server
        log.info("KV data port %d%s", server.port, " (TLS)" if ssl_context else "")

    def _bind(self, listen: str) -> int:
        cfg = self.config
        if cfg.tls_cert:
            return self._server.add_secure_port(listen, server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca))
        return self._server.add_insecure_port(listen)

    def _start_heartbeats(self) -> None:
        from registry.client import RegistryClient

        cfg = self.config
        address = cfg.advertise_address or self.address
        registration = Registration(cfg.site, address, [served(model, cfg.role) for model in self.models.values()],
                                    cfg.heartbeat_interval_s, cfg.region, cfg.country, cfg.lat, cfg.lon)
        client = RegistryClient(cfg.registry_url, cfg.site_token,
                                verify=client_context(cfg.tls_ca) if cfg.tls_ca else True)
        self.heartbeats = HeartbeatLoop(client, registration, self.capacity, self._on_registry_status,
                                        self._on_site_deleted)
        self.heartbeats.start()
        settings = LinkSettings(cfg.link_probe_interval_s, cfg.link_probe_bytes, cfg.link_report_interval_s)
        self.link_loop = LinkLoop(client, self.core.links, self.core.probe_peer, settings)
        self.link_loop.start()

    def request_drain(self, deadline_s: float | None = None) -> None:
        """Start draining in the background (Drain RPC, SIGTERM, the operator via the registry)."""
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self.drain(deadline_s), name="drain")

    async def drain(self, deadline_s: float | None = None) -> None:
        """Stop taking work, finish in-flight requests, release leases, deregister, stop."""
        if self.core.draining:
            await self._stopped.wait()
            return
        deadline_s = self.config.drain_timeout_s if deadline_s is None else deadline_s
        log.info("draining (deadline %.1fs)", deadline_s)
        self.core.draining = True
        if self.site_deleted:
            if self.link_loop is not None:
                await self.link_loop.stop()  # its calls would be refused too
        elif self.heartbeats is not None:
            await self.heartbeats.beat_now()  # tell routers at once, not at the next interval
        await self.core.drain(deadline_s)
        await self.stop(deregister=not self.site_deleted)

    async def stop(self, deregister: bool = False) -> None:
        """Stop now: in-flight streams are cancelled (their blocks freed), engines shut down."""
        if self._stopped.is_set():
            return
        if self._engine_watch is not None and self._engine_watch is not asyncio.current_task():
            self._engine_watch.cancel()
        if self.link_loop is not None:
            await self.link_loop.stop()  # before the heartbeats close the registry client they share
        if self.heartbeats is not None:
            await self.heartbeats.stop(deregister)
        if self.servicer is not None:
            self.servicer.stop_sessions()   # an idle session would hold the stop below for its whole grace
        if self._server is not None:
            await self._server.stop(STOP_GRACE_S)
        if self._metrics_server is not None:
            await self._metrics_server.stop()
        if self.core is not None:
            if self.core.kv_data_server is not None:
                await self.core.kv_data_server.stop()
            await self.core.close()
        for model in self.models.values():
            await asyncio.to_thread(model.engine.shutdown)
        self._stopped.set()

    async def _watch_engines(self) -> None:
        while not self._stopped.is_set():
            await asyncio.sleep(ENGINE_WATCH_S)
            dead = {name: model.engine.error for name, model in self.models.items() if not model.engine.alive}
            if dead and not self._stopped.is_set():
                await self._engine_failed(dead)
                return

    async def _engine_failed(self, dead: dict[str, BaseException | None]) -> None:
        for name, error in dead.items():
            log.error("the engine of model %s stopped (%s); agent %s stops with exit status 1 for its supervisor "
                      "to restart it", name, error, self.config.site)
        self.exit_code = 1
        self.core.draining = True  # admission refuses new work; Health is NOT_SERVING (the engine is not alive)
        if self.heartbeats is not None:
            await self.heartbeats.beat_now()  # routers stop placing here before the site leaves the registry
        await asyncio.sleep(FAILED_LINGER_S)
        await self.stop(deregister=True)

    async def kill_server(self) -> None:
        """Tests: drop every connection at once, as if the site died (engines keep running)."""
        await self._server.stop(0)
        if self.core.kv_data_server is not None:
            await self.core.kv_data_server.stop()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # -- reporting ---------------------------------------------------------------------------

    def _on_site_deleted(self, line: str) -> None:
        """The registry says an operator deleted this site: it will place nothing here again and refuses
        every call of this agent, so the agent drains (a drain under way goes on) and exits, not restarted."""
        if self.site_deleted:
            return
        self.site_deleted = True
        self.exit_code = SITE_DELETED_EXIT_STATUS
        log.error("%s", line)
        if self.link_loop is not None:   # its calls would be refused too, also while a drain already under way ends
            self._link_stop = asyncio.get_running_loop().create_task(self.link_loop.stop(), name="link-stop")
        self.request_drain()

    def _on_registry_status(self, status: dict) -> None:
        self.core.set_active_role(status.get("active_role"))
        if status.get("state") == "draining" and not self.core.draining:
            deadline = status.get("drain_deadline")
            deadline_s = max(0.0, deadline - time.time()) if deadline else None
            log.info("the registry asks this site to drain")
            self.request_drain(deadline_s)

    async def capacity(self) -> CapacityReport:
        """The heartbeat body: each hosted model's engine figures and prefix-cache hashes (summed for the
        site, and apart per model when there are several), and the GPUs they run on."""
        figures = {}
        for model in self.models.values():
            if not model.engine.alive:  # its last figures; the site reports draining until it stops
                figures[model.name] = ModelFigures(model.engine.latest_stats)
                continue
            model_stats = await model.engine.stats()
            self.metrics.observe_stats(model.name, model_stats)
            summary = await model.engine.cache_summary()
            figures[model.name] = ModelFigures(model_stats, summary["hashes"], summary["num_held"])
        return site_capacity_report(self.config.block_size, self.core.draining, figures)

    async def refresh_metrics(self) -> None:
        for model in self.models.values():
            if model.engine.alive:
                self.metrics.observe_stats(model.name, await model.engine.stats())
        self.metrics.observe_links(self.core.links.peers)
        self.metrics.observe_role(self.core.role)
