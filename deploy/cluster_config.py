"""What a one-machine cluster is made of: the sites (cities, roles), ports, tokens and the model.

`ClusterConfig` comes from `edgefire up` flags (`demo_config`) or a `cluster.toml` (`load_cluster_toml`):

    model = "/models/Llama-3.2-1B-Instruct"   # optional: the state dir's demo model when absent (demo_model_dir)
    router_port = 8080
    routers = 2                                # optional: routers sharing keys' limits (ports from router_port up)
    registry_replicas = 2                      # optional: registry processes over one database
    db = "postgresql+psycopg://user@db:5432/edgefire"   # optional: the registry's database (default SQLite)
    planner = true                             # optional: the prefill/decode pool planner (registry)
    [router]                                   # any RouterConfig field
    lat = 38.7
    lon = -9.1
    [agent]                                    # any AgentConfig field, for every site
    kv_cache_bytes = 134217728
    [planner_settings]                         # any registry.planner.PlannerSettings field
    min_dwell_s = 60
    [[sites]]
    name = "lisbon"
    region = "eu-west"
    country = "PT"
    lat = 38.72
    lon = -9.14
    role = "prefill"                           # prefill | decode | both
    cpus = [0]                                 # optional: pin this agent to these CPUs (Linux, taskset)
    [sites.agent]                              # AgentConfig fields for this site only
    max_num_seqs = 32

Port 0 anywhere means "pick a free port when starting" (tests use that).
A fleet: with `routers` > 1 the extra routers listen on router_port + 1, + 2, ... (or free ports when
router_port is 0), likewise the extra registry replicas after registry_port. Every router and agent
is given every replica's URL, each starting at a different one, so losing one moves some of them.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

import typed_config
from node_agent.config import ROLES, AgentConfig
from registry import validate as registry_rules
from registry.errors import InvalidInput
from registry.planner import PlannerSettings
from registry.records import SiteSpec as RegistrySiteSpec
from router.config import RouterConfig

DEFAULT_STATE_DIR = Path(".edgefire/cluster")
DEFAULT_DEMO_MODEL_DIR = Path(".edgefire/demo-model")   # the default state dir's (demo_model_dir)
DEFAULT_ROUTER_PORT = 8080
DEFAULT_REGISTRY_PORT = 8500
DEFAULT_GRPC_PORT = 50051
DEFAULT_METRICS_PORT = 9400
MAX_FLEET_PROCESSES = 16   # routers or registry replicas one machine runs
MAX_PORT = 65535

# Settings the launcher writes itself: a cluster file may not override them.
LAUNCHER_AGENT_FIELDS = frozenset({"site", "region", "country", "lat", "lon", "role", "models", "grpc_listen",
                                   "advertise_address", "metrics_listen", "registry_url", "site_token", "peer_token",
                                   "agent_token_sha256", "accept_peer_tokens"})
LAUNCHER_ROUTER_FIELDS = frozenset({"host", "port", "registry_url", "registry_token", "agent_token", "peer_token",
                                    "metrics_listen"})
# The cluster's tokens, each a credential of one role: two alike would let one role act as the other.
TOKENS = ("admin_token", "router_token", "agent_token", "peer_token")


# The cluster description is unusable; the message says what to change.
ClusterConfigError = typed_config.ConfigError


@dataclass(slots=True)
class SiteSpec:
    name: str
    region: str
    country: str
    lat: float
    lon: float
    role: str = "both"
    grpc_port: int = 0
    metrics_port: int = 0
    agent: dict = field(default_factory=dict)   # extra AgentConfig fields for this site
    # CPUs the agent is held to (and torch uses that many threads); empty: no pinning. On a shared
    # host this keeps sites from stealing each other's cores, as separate machines would.
    cpus: list[int] = field(default_factory=list)


# Real cities, so placement's distance-based RTTs mean something. The first three give the default
# cluster its mix of roles: a prefill-only site, a decode-only site and one doing both.
DEMO_SITES = [
    SiteSpec("lisbon", "eu-west", "PT", 38.72, -9.14, "prefill"),
    SiteSpec("frankfurt", "eu-central", "DE", 50.11, 8.68, "decode"),
    SiteSpec("warsaw", "eu-east", "PL", 52.23, 21.01, "both"),
    SiteSpec("madrid", "eu-west", "ES", 40.42, -3.70, "both"),
    SiteSpec("paris", "eu-west", "FR", 48.86, 2.35, "both"),
    SiteSpec("stockholm", "eu-north", "SE", 59.33, 18.07, "both"),
    SiteSpec("milan", "eu-south", "IT", 45.46, 9.19, "both"),
    SiteSpec("dublin", "eu-west", "IE", 53.35, -6.26, "both"),
]
# The router stands in Lisbon: a client it cannot locate is taken to be there.
DEMO_ROUTER_LOCATION = (38.72, -9.14)


@dataclass(slots=True)
class ClusterConfig:
    model_dir: Path
    sites: list[SiteSpec]
    model_name: str = ""                 # default: the checkpoint directory's name
    state_dir: Path = DEFAULT_STATE_DIR
    host: str = "127.0.0.1"
    router_port: int = DEFAULT_ROUTER_PORT
    registry_port: int = DEFAULT_REGISTRY_PORT
    router_metrics_port: int = 0         # the router's Prometheus port (0: a free one)
    admin_token: str = ""                # generated when empty; the registry's admin token
    router_token: str = ""               # routers -> registry
    agent_token: str = ""                # routers -> agents (agents are given its SHA-256, agent_token_sha256)
    peer_token: str = ""                 # agents -> agents (FetchKV, the KV data port)
    api_key: str = ""
    router: dict = field(default_factory=dict)  # extra RouterConfig fields
    agent: dict = field(default_factory=dict)   # extra AgentConfig fields for every site
    planner: bool = False                       # run the registry's prefill/decode pool planner
    planner_settings: dict = field(default_factory=dict)  # PlannerSettings fields (registry.planner)
    tls: bool = False                    # every hop over TLS, with a local CA made at start
    routers: int = 1                     # routers sharing every key's limits (router_port, then the next ports)
    registry_replicas: int = 1           # registry processes over one database
    db: str = ""                         # the registry's database URL; empty: SQLite in the state dir, made afresh
    # model_dir is edgefire's own demo model (no model was given): `up` writes it, and rewrites it when it
    # was made at another size than --demo-size asks for. A model the user names is never written.
    demo_model: bool = False

    def __post_init__(self) -> None:
        self.model_dir = Path(self.model_dir)
        self.state_dir = Path(self.state_dir)
        self.model_name = self.model_name or self.model_dir.resolve().name
        self.admin_token = self.admin_token or "efa-" + secrets.token_urlsafe(24)
        self.router_token = self.router_token or "efr-" + secrets.token_urlsafe(24)
        self.agent_token = self.agent_token or "efag-" + secrets.token_urlsafe(24)
        self.peer_token = self.peer_token or "efp-" + secrets.token_urlsafe(24)
        self.api_key = self.api_key or "ef-" + secrets.token_urlsafe(32)
        self.router = {"lat": DEMO_ROUTER_LOCATION[0], "lon": DEMO_ROUTER_LOCATION[1], **self.router}
        self.validate()

    def validate(self) -> None:
        if not self.sites:
            raise ClusterConfigError("sites: a cluster needs at least one site")
        names = [s.name for s in self.sites]
        if len(set(names)) != len(names):
            raise ClusterConfigError(f"sites: names must be unique, got {names}")
        for site in self.sites:
            _check_site_fields(site)
            if site.role not in ROLES:
                raise ClusterConfigError(f"sites.{site.name}.role: must be one of {', '.join(ROLES)}")
            site.agent = _check_table(f"sites.{site.name}.agent", site.agent, AgentConfig, LAUNCHER_AGENT_FIELDS)
            _check_cpus(site)
        roles = {s.role for s in self.sites}
        if not roles & {"prefill", "both"} or not roles & {"decode", "both"}:
            raise ClusterConfigError("sites: at least one site must prefill and one must decode")
        self.agent = _check_table("agent", self.agent, AgentConfig, LAUNCHER_AGENT_FIELDS)
        self.router = _check_table("router", self.router, RouterConfig, LAUNCHER_ROUTER_FIELDS)
        self.planner_settings = _check_table("planner_settings", self.planner_settings, PlannerSettings, frozenset())
        # settings that make no sense are refused here, naming this table, not by the registry once started
        typed_config.build(PlannerSettings, self.planner_settings, "planner_settings")
        for i, name in enumerate(TOKENS):
            for other in TOKENS[i + 1:]:
                if getattr(self, name) == getattr(self, other):
                    raise ClusterConfigError(f"{name} and {other}: must differ (each is one role's credential); "
                                             f"change one, or leave it out to have one generated")
        if len(self.api_key) < 16:
            raise ClusterConfigError("api_key: must be at least 16 characters")
        for name in ("routers", "registry_replicas"):
            if not 1 <= getattr(self, name) <= MAX_FLEET_PROCESSES:
                raise ClusterConfigError(f"{name}: must be 1 to {MAX_FLEET_PROCESSES}, got {getattr(self, name)}")
        self._check_ports()
        if self.db:
            try:
                backend = make_url(self.db).get_backend_name()
            except ArgumentError:
                backend = None
            if backend not in ("sqlite", "postgresql"):
                raise ClusterConfigError(f"db: {self.db!r} is not a SQLite or PostgreSQL URL "
                                         f"(e.g. postgresql+psycopg://user@host:5432/edgefire)")

    def _check_ports(self) -> None:
        """Every fixed port in range and used once, checked before anything starts: a clash would
        otherwise surface only as a process refusing to start (an agent's gRPC port) or dying at start,
        after the others were up."""
        users: dict[int, str] = {}
        for setting, port in self.fixed_ports():
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= MAX_PORT:
                raise ClusterConfigError(f"{setting}: must be a port in 1-{MAX_PORT} (0: a free one), got {port!r}")
            if port and port in users:
                raise ClusterConfigError(f"{users[port]} and {setting}: both use port {port}; give each its own "
                                         f"port (or 0 for a free one)")
            users.setdefault(port, setting)

    def fixed_ports(self) -> list[tuple[str, int]]:
        """(setting, port) for every port the cluster's processes listen on, as configured."""
        ports = [("router_port" if i == 0 else f"router_port + {i} (router {i + 1})", self.router_port + i)
                 for i in range(self.routers if self.router_port else 1)]
        ports += [("registry_port" if i == 0 else f"registry_port + {i} (registry replica {i + 1})",
                   self.registry_port + i) for i in range(self.registry_replicas if self.registry_port else 1)]
        ports.append(("router_metrics_port", self.router_metrics_port))
        for site in self.sites:
            ports += [(f"sites.{site.name}.grpc_port", site.grpc_port),
                      (f"sites.{site.name}.metrics_port", site.metrics_port)]
            if site.agent.get("kv_data_port") is not None:
                ports.append((f"sites.{site.name}.agent.kv_data_port", site.agent["kv_data_port"]))
            elif "kv_data_port" not in site.agent and self.agent.get("kv_data_port") is not None:
                ports.append((f"agent.kv_data_port (site {site.name})", self.agent["kv_data_port"]))
        return ports


def _check_site_fields(site: SiteSpec) -> None:
    """The registry's own rules for a site's name and location, checked before anything starts."""
    try:
        registry_rules.site_name(site.name)
        registry_rules.site_spec(RegistrySiteSpec(region=site.region, country=site.country, lat=site.lat, lon=site.lon))
    except InvalidInput as exc:
        raise ClusterConfigError(f"sites.{site.name}: {exc.message}") from None


def _check_table(table: str, values: dict, config_class, owned) -> dict:
    """A table of `config_class` settings, typed and known, none of them the launcher's own."""
    for name in values:
        if name in owned:
            raise ClusterConfigError(f"{table}.{name}: set by the launcher; remove it from the cluster file")
    return typed_config.check_values(config_class, values, table)


def _check_cpus(site: SiteSpec) -> None:
    if not site.cpus:
        return
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in site.cpus):
        raise ClusterConfigError(f"sites.{site.name}.cpus: must be a list of CPU numbers (>= 0), got {site.cpus}")
    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if available is None or shutil.which("taskset") is None:
        raise ClusterConfigError(f"sites.{site.name}.cpus: pinning needs Linux with taskset (util-linux); "
                                 f"remove cpus on this machine")
    missing = sorted(set(site.cpus) - set(available))
    if missing:
        raise ClusterConfigError(f"sites.{site.name}.cpus: CPU(s) {missing} are not available to this process "
                                 f"(available: {available})")


def demo_sites(num_sites: int) -> list[SiteSpec]:
    """The first `num_sites` demo cities; fewer than three sites all do both roles."""
    if num_sites < 1:
        raise ClusterConfigError("--sites: must be at least 1")
    sites = []
    for i in range(num_sites):
        base = DEMO_SITES[i % len(DEMO_SITES)]
        name = base.name if i < len(DEMO_SITES) else f"{base.name}-{i // len(DEMO_SITES) + 1}"
        role = base.role if num_sites >= 3 else "both"
        sites.append(dataclasses.replace(base, name=name, role=role, agent={}))
    return sites


def demo_model_dir(state_dir: str | Path) -> Path:
    """Where the cluster in `state_dir` keeps its demo model: in the state dir, whose one launcher (it holds
    the state dir's lock) is the only one to write it, so an `up` with another --demo-size beside a running
    cluster never rewrites the weights that cluster's agents serve. The default state dir keeps the demo
    model where `make run` has always made it, beside it in .edgefire/."""
    if Path(state_dir).resolve() == DEFAULT_STATE_DIR.resolve():
        return DEFAULT_DEMO_MODEL_DIR
    return Path(state_dir) / DEFAULT_DEMO_MODEL_DIR.name


def load_cluster_toml(path: str | Path, **overrides) -> ClusterConfig:
    """A cluster file; `overrides` (flags given on the command line) win over its values."""
    document = typed_config.read_toml(path)
    sites = []
    for i, table in enumerate(typed_config.check_value(list[dict], document.pop("sites", []), f"{path}: sites")):
        where = f"{path}: sites[{i}]"
        sites.append(typed_config.build(SiteSpec, typed_config.check_values(SiteSpec, table, where), where))
    values = {"sites": sites}
    if "model" in document:
        values["model_dir"] = typed_config.check_value(Path, document.pop("model"), f"{path}: model")
    cluster_keys = {f.name for f in dataclasses.fields(ClusterConfig)} - {"model_dir", "sites", "demo_model"}
    for name in document:
        if name not in cluster_keys:
            raise ClusterConfigError(f"{path}: {name}: unknown cluster setting (known: model, sites, "
                                     f"{', '.join(sorted(cluster_keys))})")
    values.update(typed_config.check_values(ClusterConfig, document, str(path)))
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "model_dir" not in values:
        values.update(model_dir=demo_model_dir(values.get("state_dir", DEFAULT_STATE_DIR)), demo_model=True)
    try:
        return ClusterConfig(**values)
    except ClusterConfigError as exc:
        raise ClusterConfigError(f"{path}: {exc}") from None
