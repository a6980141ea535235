"""`Cluster`: the whole system on one machine, as real processes on loopback.

    cluster = Cluster(config)      # deploy.cluster_config.ClusterConfig
    cluster.start()                # registry (migrated, seeded), one agent per site, router(s)
    ...                            # cluster.router_url, cluster.api_key, cluster.admin()
    cluster.stop()                 # routers, then agents (side by side, each drains), then the registry

`edgefire up` and the end-to-end tests both drive this class. A fleet (`routers`, `registry_replicas`)
runs `router`, `router-2`, ... and `registry`, `registry-2`, ...; every router and agent gets every
replica's URL, each list starting at a different replica. The database is SQLite in the state
directory, made afresh at every start, or the `db` URL (PostgreSQL), which is migrated and seeded
(sites, their tokens, the API key) but never emptied. Everything it writes lives in the state
directory: `registry.db`, `config/<process>.toml` (0600: they hold tokens), `logs/<process>.log`,
`run/<process>.pid`, and `cluster.json` (URLs and tokens, for `edgefire status`). With `tls`, a
fresh local CA (deploy.tls) signs one certificate per process into `tls/` (keys 0600; the CA's key
is never written), and every hop is TLS: HTTPS to the registry and router, gRPC and the KV data
port with client certificates demanded by the agents.
One launcher owns a state directory at a time (a lock on `launcher.pid`, see claim_state_dir). A start
first kills whatever a crashed launcher left behind (from its pid files) and starts the registry from
an empty database, so a second `up` after a crash starts cleanly.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx

from deploy.cluster_config import ClusterConfig, SiteSpec
from deploy.processes import ManagedProcess, free_port, kill_stale, stop_together, wait_ports_free
from deploy.tls import LocalCA, local_hosts
from node_agent.auth import token_digest
from node_agent.tls import channel_credentials, client_context
from registry.client import SyncRegistryClient

log = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0
REGISTRY_NAME = "registry"
ROUTER_NAME = "router"
# Defaults for a cluster of CPU processes sharing one machine; a cluster file's [agent] / [router] win.
AGENT_DEFAULTS = {"heartbeat_interval_s": 1.0, "kv_cache_bytes": 64 << 20, "drain_timeout_s": 10.0}
ROUTER_DEFAULTS = {"snapshot_refresh_s": 0.5, "first_token_timeout_s": 20.0, "token_idle_timeout_s": 20.0,
                   "failures_to_cool_down": 1, "cooldown_s": 10.0}


class ClusterError(RuntimeError):
    """The cluster could not start (or a process died); the message says which and where its log is."""


class Cluster:
    def __init__(self, config: ClusterConfig, python: str = sys.executable) -> None:
        self.config = config
        self.python = python
        self.state_dir = config.state_dir.resolve()
        self.processes: dict[str, ManagedProcess] = {}
        self._admin: SyncRegistryClient | None = None
        self._lock_fd: int | None = None   # launcher.pid, locked while this launcher owns the state dir
        self._verify = True  # how HTTPS clients check the cluster's certificates; an SSLContext under tls
        self._registry_ports: list[int] = [config.registry_port]
        self._router_ports: list[int] = [config.router_port]
        self._router_metrics_ports: list[int] = [config.router_metrics_port]

    # -- addresses ---------------------------------------------------------------------------

    @property
    def scheme(self) -> str:
        return "https" if self.config.tls else "http"

    @property
    def registry_url(self) -> str:
        return self.registry_urls[0]

    @property
    def registry_urls(self) -> list[str]:
        return [f"{self.scheme}://{self.config.host}:{port}" for port in self._registry_ports]

    @property
    def router_url(self) -> str:
        return self.router_urls[0]

    @property
    def router_urls(self) -> list[str]:
        return [f"{self.scheme}://{self.config.host}:{port}" for port in self._router_ports]

    @property
    def registry_names(self) -> list[str]:
        return [_numbered(REGISTRY_NAME, i) for i in range(self.config.registry_replicas)]

    @property
    def router_names(self) -> list[str]:
        return [_numbered(ROUTER_NAME, i) for i in range(self.config.routers)]

    @property
    def ca_path(self) -> Path | None:
        """The CA bundle clients verify the cluster with (None without tls)."""
        return self.state_dir / "tls" / "ca.pem" if self.config.tls else None

    def agent_credentials(self) -> grpc.ChannelCredentials | None:
        """For calling the cluster's agents directly (tools, tests): the router's identity under tls."""
        if not self.config.tls:
            return None
        return channel_credentials(str(self.ca_path), *self.tls_files(ROUTER_NAME))

    def metrics_url(self, name: str) -> str:
        return f"{self.scheme}://{self.config.host}:{self.site(name).metrics_port}/metrics"

    @property
    def router_metrics_url(self) -> str:
        return f"{self.scheme}://{self.config.host}:{self.config.router_metrics_port}/metrics"

    def http_client(self, **options) -> httpx.Client:
        """An httpx client that trusts this cluster's certificates."""
        return httpx.Client(verify=self._verify, **options)

    @property
    def api_key(self) -> str:
        return self.config.api_key

    @property
    def model(self) -> str:
        return self.config.model_name

    @property
    def db_url(self) -> str:
        return self.config.db or f"sqlite:///{self.state_dir / 'registry.db'}"

    def site(self, name: str) -> SiteSpec:
        return next(s for s in self.config.sites if s.name == name)

    def site_address(self, name: str) -> str:
        return f"{self.config.host}:{self.site(name).grpc_port}"

    def admin(self) -> SyncRegistryClient:
        if self._admin is None:
            self._admin = SyncRegistryClient(self.registry_urls, self.config.admin_token, actor="launcher",
                                             verify=self._verify)
        return self._admin

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """From nothing to serving; on failure everything started is stopped again."""
        try:
            self.claim_state_dir()
            self._prepare_state_dir()
            if self.config.tls:
                self._make_certificates()
            self._assign_ports()
            self._seed_registry()
            for i in range(self.config.registry_replicas):
                self._start_registry(i)
            for i, site in enumerate(self.config.sites):
                self._start_agent(site, i)
            deadline = time.monotonic() + timeout_s
            self.wait_for(lambda: all(self.site_alive(s.name) for s in self.config.sites),
                          deadline - time.monotonic(), "every site to register and heartbeat")
            for i in range(self.config.routers):
                self._start_router(i)
            self.wait_for(self._router_ready, deadline - time.monotonic(), "the router(s) to list the model")
            self._write_cluster_json()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Routers first (no new requests), then agents (they drain and deregister), then the registry."""
        self._close_admin()
        tiers = [self.router_names, [s.name for s in self.config.sites], self.registry_names]
        for tier in tiers:   # each tier's processes at once: the agents drain side by side
            processes = [self.processes[name] for name in tier if name in self.processes]
            for name, code in stop_together(processes, signal.SIGTERM).items():
                if code not in (None, 0, -signal.SIGTERM, -signal.SIGKILL):
                    log.info("%s exited with %s (log: %s)", name, code, self.processes[name].log_path)
        self._release_state_dir()

    def kill_all(self) -> None:
        """SIGKILL to every process of the cluster, no drain: what a second interrupt during stop() asks for."""
        self._close_admin()
        for process in self.processes.values():
            process.kill()
        self._release_state_dir()

    def _close_admin(self) -> None:
        # Hang up before stopping the registry rather than leave it a connection to cut; admin()
        # opens a new one when needed.
        if self._admin is not None:
            self._admin.close()
            self._admin = None

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()

    # -- faults and restarts (tests, the supervisor) -------------------------------------------

    def kill_site(self, name: str) -> None:
        """kill -9 a site's agent (no drain, no deregistration; the registry ages it out), or any other
        process of the cluster by name: `router-2`, `registry`, ..."""
        self.processes[name].kill()

    def start_site(self, name: str, wait: bool = True, timeout_s: float = 60.0) -> None:
        """(Re)starts a site's agent; waits until this process serves and has heartbeated."""
        self.processes[name].start()
        if wait:
            # The registry may still show the old process alive, so first wait for the new one to serve.
            self.wait_for(lambda: self._agent_serving(name), timeout_s, f"site {name} to serve again")
            self.wait_for(lambda: self.site_alive(name), timeout_s, f"site {name} to heartbeat again")

    def stop_registry(self) -> None:
        """Stops every registry replica (a registry outage)."""
        self._close_admin()
        stop_together([self.processes[name] for name in self.registry_names], signal.SIGTERM)

    def start_registry(self, timeout_s: float = 30.0) -> None:
        for name in self.registry_names:
            self.processes[name].start()
        self.wait_for(self._registry_ready, timeout_s, "the registry to answer")

    def dead_processes(self) -> list[ManagedProcess]:
        """Processes that exited without being stopped (crashed, or failed to start)."""
        return [p for p in self.processes.values() if p.crashed()]

    # -- readiness -----------------------------------------------------------------------------

    def snapshot(self) -> dict:
        return self.admin().admin_snapshot()

    def site_state(self, name: str) -> dict | None:
        return next((s for s in self.snapshot()["sites"] if s["name"] == name), None)

    def site_alive(self, name: str) -> bool:
        site = self.site_state(name)
        return bool(site and site["alive"] and site["capacity"] and site["grpc_address"])

    def wait_for(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Polls `condition` (connection errors count as not yet); fails early when a child dies."""
        deadline = time.monotonic() + timeout_s
        while True:
            dead = self.dead_processes()
            if dead:
                p = dead[0]
                raise ClusterError(f"{p.name} exited with code {p.exit_code()} while waiting for {what}; "
                                   f"its log ({p.log_path}) ends:\n{p.log_tail()}")
            try:
                if condition():
                    return
            except (httpx.HTTPError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out waiting for {what}; logs are in {self.state_dir / 'logs'}")
            time.sleep(0.2)

    def _agent_serving(self, name: str) -> bool:
        """The agent's metrics endpoint answers only after its engines loaded and its gRPC server started."""
        return httpx.get(self.metrics_url(name), timeout=2.0, verify=self._verify).status_code == 200

    def _registry_ready(self, index: int | None = None) -> bool:
        urls = self.registry_urls if index is None else [self.registry_urls[index]]
        return all(httpx.get(f"{url}/healthz", timeout=2.0, verify=self._verify).status_code == 200 for url in urls)

    def _router_ready(self) -> bool:
        for url in self.router_urls:
            response = httpx.get(f"{url}/v1/models", timeout=2.0, verify=self._verify,
                                 headers={"Authorization": f"Bearer {self.api_key}"})
            if response.status_code != 200 or not any(m["id"] == self.model for m in response.json()["data"]):
                return False
        return True

    # -- setup ---------------------------------------------------------------------------------

    def _prepare_state_dir(self) -> None:
        for name in ("config", "logs", "run"):
            (self.state_dir / name).mkdir(parents=True, exist_ok=True)
        killed = kill_stale(self.state_dir / "run")
        if killed:
            log.warning("stopped processes left by an earlier launcher: %s", ", ".join(killed))
        ports = [*_run_of(self.config.registry_port, self.config.registry_replicas),
                 *_run_of(self.config.router_port, self.config.routers), self.config.router_metrics_port]
        ports += [p for s in self.config.sites for p in (s.grpc_port, s.metrics_port)]
        busy = wait_ports_free(self.config.host, ports, timeout_s=10.0 if killed else 0.5)
        if busy:
            raise ClusterError(f"port(s) {', '.join(map(str, busy))} on {self.config.host} are in use by another "
                               f"program; stop it or choose other ports (--port, or a cluster file)")
        if not self.config.db:
            for path in self.state_dir.glob("registry.db*"):
                path.unlink()  # every start begins from an empty registry: no stale sites or keys

    def claim_state_dir(self) -> None:
        """Makes this the state directory's one launcher, or raises ClusterError naming the one that is.
        An exclusive lock on launcher.pid, held until stop(): the kernel drops it when this process ends,
        however it ends, so a killed launcher leaves no claim behind, and two `up`s started at the same
        moment cannot both pass (reading the pid file, then writing it, let both through)."""
        if self._lock_fd is not None:
            return
        pid_path = self.state_dir / "launcher.pid"
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            os.close(os.open(pid_path, os.O_RDWR | os.O_CREAT, 0o644))
        except OSError as exc:
            why = "it is a file, not a directory" if isinstance(exc, FileExistsError) else exc.strerror
            raise ClusterError(f"state dir {self.state_dir}: cannot write there ({why}); give a directory "
                               f"this user may write with --state-dir") from None
        while True:
            fd = os.open(pid_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise ClusterError(f"another launcher (pid {holder}) runs a cluster in {self.state_dir}; stop it "
                                   f"first, or give another --state-dir (and other ports)") from None
            try:
                same_file = os.stat(pid_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same_file = False
            if same_file:   # not a file the previous launcher unlinked as this one opened it
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def _release_state_dir(self) -> None:
        if self._lock_fd is None:
            return   # never claimed: launcher.pid is another launcher's
        (self.state_dir / "launcher.pid").unlink(missing_ok=True)
        os.close(self._lock_fd)
        self._lock_fd = None

    def _make_certificates(self) -> None:
        ca = LocalCA(f"edgefire local CA ({self.state_dir})")
        directory = self.state_dir / "tls"
        directory.mkdir(exist_ok=True)
        for path in directory.glob("*.pem"):
            path.unlink()  # a new CA: nothing signed by an earlier one stays around
        self.ca_path.write_bytes(ca.cert_pem)
        hosts = local_hosts(self.config.host)
        for name in (*self.registry_names, *self.router_names, *(s.name for s in self.config.sites)):
            cert, key = ca.issue(name, hosts)
            (directory / f"{name}.pem").write_bytes(cert)
            _write_private(directory / f"{name}-key.pem", key.decode())
        self._verify = client_context(str(self.ca_path))

    def tls_files(self, name: str) -> tuple[str, str]:
        """(certificate, key) paths of a process's TLS identity."""
        directory = self.state_dir / "tls"
        return str(directory / f"{name}.pem"), str(directory / f"{name}-key.pem")

    def _assign_ports(self) -> None:
        c, host = self.config, self.config.host
        # Nothing binds until the processes start, so each pick must avoid the fixed ports and the earlier
        # picks (with 50 sites two agents were given one port in about a third of the starts).
        taken = {port for _setting, port in c.fixed_ports() if port}

        def pick() -> int:
            port = free_port(host, taken)
            taken.add(port)
            return port

        self._registry_ports = _run_of(c.registry_port, c.registry_replicas) or [
            pick() for _ in range(c.registry_replicas)]
        self._router_ports = _run_of(c.router_port, c.routers) or [pick() for _ in range(c.routers)]
        c.registry_port, c.router_port = self._registry_ports[0], self._router_ports[0]
        c.router_metrics_port = c.router_metrics_port or pick()
        self._router_metrics_ports = [c.router_metrics_port] + [pick() for _ in range(1, c.routers)]
        for site in c.sites:
            site.grpc_port = site.grpc_port or pick()
            site.metrics_port = site.metrics_port or pick()

    def _seed_registry(self) -> None:
        """Migrates the registry database and creates (or, in a kept PostgreSQL one, updates) the sites,
        their tokens and the API key."""
        from registry.migrate import upgrade_to_head
        from registry.records import ApiKeySpec, ModelServed
        from registry.records import SiteSpec as RegistrySiteSpec
        from registry.store import RegistryStore

        upgrade_to_head(self.db_url)
        store = RegistryStore.open(self.db_url)
        try:
            self._site_tokens = {}
            for site in self.config.sites:
                spec = RegistrySiteSpec(region=site.region, country=site.country, lat=site.lat, lon=site.lon,
                                        models=[ModelServed(self.model, site.role)])
                store.sites.put(site.name, spec, actor="launcher")
                # A kept database may hold this site's token from an earlier run: that one stops working.
                self._site_tokens[site.name] = store.access.issue_site_token(site.name, actor="launcher",
                                                                             revoke_previous=True)
            if store.access.lookup_api_key(self.api_key) is None:
                store.access.create_api_key(ApiKeySpec("edgefire-up"), actor="launcher", secret=self.api_key)
        finally:
            store.close()

    def _process(self, name: str, args: list[str], env: dict[str, str] | None = None,
                 cpus: list[int] | None = None) -> ManagedProcess:
        argv = [self.python, "-m", "deploy.cli", "--log-level", os.environ.get("EDGEFIRE_LOG_LEVEL", "INFO"), *args]
        threads = str(max(1, (os.cpu_count() or 1) // max(1, len(self.config.sites))))
        if cpus:
            # taskset sets the affinity before Python starts, so every thread (torch's, gRPC's) inherits it.
            argv = ["taskset", "--cpu-list", ",".join(map(str, cpus)), *argv]
            env = {**(env or {}), "OMP_NUM_THREADS": str(len(cpus))}
        base_env = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
        process = ManagedProcess(name, argv, self.state_dir / "logs" / f"{name}.log",
                                 self.state_dir / "run" / f"{name}.pid", {**base_env, **(env or {})}, kind=args[0])
        self.processes[name] = process
        return process

    def _start_registry(self, index: int) -> None:
        c, name = self.config, self.registry_names[index]
        planner = []
        if c.planner:   # on every replica: a lease keeps one planner active at a time
            path = self._write_toml("planner", {"planner": c.planner_settings})
            planner = ["--planner", "--planner-config", str(path)]
        cert, key = self.tls_files(name)
        tls = ["--tls-cert", cert, "--tls-key", key] if c.tls else []
        self._process(name, ["registry", "serve", "--db", self.db_url, "--host", c.host,
                             "--port", str(self._registry_ports[index]), "--no-migrate", *planner, *tls],
                      {"EDGEFIRE_ADMIN_TOKEN": c.admin_token, "EDGEFIRE_ROUTER_TOKEN": c.router_token}).start()
        self.wait_for(lambda: self._registry_ready(index), 30.0, f"{name} to answer")

    def agent_settings(self, site: SiteSpec, index: int = 0) -> dict:
        c = self.config
        return {**AGENT_DEFAULTS, **c.agent, **site.agent,
                "site": site.name, "region": site.region, "country": site.country, "lat": site.lat,
                "lon": site.lon, "role": site.role, "models": {self.model: str(c.model_dir.resolve())},
                "grpc_listen": f"{c.host}:{site.grpc_port}", "metrics_listen": f"{c.host}:{site.metrics_port}",
                "registry_url": self._registry_list(index), "site_token": self._site_tokens[site.name],
                "peer_token": c.peer_token, "agent_token_sha256": token_digest(c.agent_token),
                **self._agent_tls(site.name)}

    def router_settings(self, index: int = 0) -> dict:
        c = self.config
        return {**ROUTER_DEFAULTS, **c.router, "host": c.host, "port": self._router_ports[index],
                "metrics_listen": f"{c.host}:{self._router_metrics_ports[index]}",
                "name": self.router_names[index], "registry_url": self._registry_list(index),
                "registry_token": c.router_token, "agent_token": c.agent_token, **self._router_tls(index)}

    def _registry_list(self, index: int) -> str | list[str]:
        """Every replica's URL, starting at a different one for each router or agent (one URL: a string)."""
        urls = self.registry_urls
        if len(urls) == 1:
            return urls[0]
        start = index % len(urls)
        return urls[start:] + urls[:start]

    def _agent_tls(self, name: str) -> dict:
        if not self.config.tls:
            return {}
        cert, key = self.tls_files(name)
        ca = str(self.ca_path)
        return {"tls_cert": cert, "tls_key": key, "tls_ca": ca, "tls_client_ca": ca, "metrics_tls": True}

    def _router_tls(self, index: int = 0) -> dict:
        if not self.config.tls:
            return {}
        cert, key = self.tls_files(self.router_names[index])
        return {"tls_cert": cert, "tls_key": key, "tls_ca": str(self.ca_path), "agent_tls": True,
                "agent_client_cert": cert, "agent_client_key": key, "metrics_tls": True}

    def _start_agent(self, site: SiteSpec, index: int) -> None:
        path = self._write_toml(site.name, self.agent_settings(site, index))
        self._process(site.name, ["agent", "--config", str(path)], cpus=site.cpus).start()

    def _start_router(self, index: int) -> None:
        name = self.router_names[index]
        path = self._write_toml(name, {"router": self.router_settings(index)})
        self._process(name, ["router", "--config", str(path)]).start()

    def _write_toml(self, name: str, document: dict) -> Path:
        path = self.state_dir / "config" / f"{name}.toml"
        _write_private(path, to_toml(document))
        return path

    def _write_cluster_json(self) -> None:
        c = self.config
        document = {"registry_url": self.registry_url, "router_url": self.router_url,
                    "router_metrics": self.router_metrics_url, "dashboard": f"{self.registry_url}/dashboard",
                    "registry_urls": self.registry_urls, "router_urls": self.router_urls, "model": self.model,
                    "ca": str(self.ca_path) if self.ca_path else None,
                    "admin_token": c.admin_token, "api_key": c.api_key, "launcher_pid": os.getpid(),
                    "sites": {s.name: {"role": s.role, "city": s.name, "grpc_address": self.site_address(s.name),
                                       "metrics": self.metrics_url(s.name),
                                       "log": str(self.processes[s.name].log_path)} for s in c.sites}}
        _write_private(self.state_dir / "cluster.json", json.dumps(document, indent=2) + "\n")


def _numbered(name: str, index: int) -> str:
    """router, router-2, router-3, ... (the first keeps the plain name)."""
    return name if index == 0 else f"{name}-{index + 1}"


def _run_of(port: int, count: int) -> list[int]:
    """`count` consecutive ports from `port`; none when `port` is 0 (free ports are picked instead)."""
    return [port + i for i in range(count)] if port else []


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # the mode above applies only to a new file; one left by an older run may be readable
    with os.fdopen(fd, "w") as f:
        f.write(text)


def to_toml(document: dict) -> str:
    """The TOML the configs need: scalars, lists of scalars, and one level of tables."""
    lines, tables = [], []
    for key, value in document.items():
        if value is None:
            continue  # TOML has no null: leaving the key out keeps the field's default
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    for key, table in tables:
        lines.append(f"\n[{key}]")
        lines.extend(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items() if v is not None)
    return "\n".join(lines) + "\n"


def _toml_key(key: str) -> str:
    return key if key.replace("-", "").replace("_", "").isalnum() else json.dumps(key)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
