"""The router's configuration: one dataclass, loaded from TOML (a `[router]` table or top-level keys).

Loading is `typed_config`'s (shared with the agent): unknown keys, ill-typed values and bad ranges are
refused at start with the file and key named, rather than silently keeping a default or failing later.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

import typed_config
from registry.allowance import GRANT_TTL_S
from node_agent.tls import check_bundle, check_identity
from registry.client import registry_urls
from router.reasoning import parser_names
from router.tool_calls import parser_names as tool_call_parser_names
from typed_config import ConfigError

_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token (RFC 9110)


@dataclass(slots=True)
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    # The registry: one URL, or several replicas (a list, or comma-separated) tried in order on failure.
    registry_url: str | list[str] = "http://127.0.0.1:8500"
    registry_token: str = ""          # the registry's router token
    name: str = ""                    # how operators see this router (registry `routers`, logs); any text
    # Usage and rate-limit charges go to the registry this often; the answer brings this router's share
    # of every key's limits (router/rate_limit.py). A router that dies loses at most one interval of usage.
    report_interval_s: float = 1.0
    # The token this router presents to agents (node_agent.auth); agents hold its SHA-256 as
    # agent_token_sha256. Not the agents' peer_token: every site holds that one, and an agent split by
    # role refuses it on Generate, Prefill, Decode, GetModelInfo and Drain.
    agent_token: str = ""
    peer_token: str = ""              # the old name of agent_token, from before the split: sent as it
    # TLS. tls_cert/tls_key: serve HTTPS. tls_ca: the CA bundle that verifies agents and an https
    # registry (None: the system roots). agent_tls: call agents over TLS; agent_client_cert/key answer
    # agents that demand client certificates (mutual TLS).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    agent_tls: bool = False
    agent_client_cert: str | None = None
    agent_client_key: str | None = None
    # Requests to an agent share one long-lived gRPC stream (Session), which carries each engine step's
    # tokens of all of them as one message; false: one Generate/Decode stream per request, as before.
    # Agents without the Session RPC get per-request calls either way.
    agent_sessions: bool = True
    # Prometheus: /metrics on a port of its own, apart from the public API (node_agent.metrics_server).
    # It asks for no token: bind it to an internal interface. None: no metrics port.
    metrics_listen: str | None = None    # host:port, e.g. "10.0.0.5:9401" (port 0: any free port)
    metrics_tls: bool = False            # serve it over HTTPS with tls_cert
    placement_report_interval_s: float = 5.0  # the pairs placed go to the registry (dashboard arcs); 0: never
    # Where this router stands: the location of clients we cannot place (anycast puts them near us).
    lat: float = 0.0
    lon: float = 0.0
    site: str | None = None           # the site this router runs beside: its measured links give client RTTs
    geoip_db: str | None = None       # GeoIP2/GeoLite2 City .mmdb; reloaded on SIGHUP ("": none)
    # Headers are believed only from trusted_proxies. The forwarded-for header is X-Forwarded-For style
    # (addresses, nearest proxy last), or RFC 7239 when it is "forwarded" (`for=` of each element).
    location_header: str | None = None        # "lat,lon" set by a trusted front proxy
    forwarded_for_header: str = "x-forwarded-for"
    trusted_proxies: list[str] = field(default_factory=list)  # CIDRs whose headers we believe
    # Registry snapshot.
    snapshot_refresh_s: float = 1.0
    # The registry's snapshot is trusted as is this long; past it (registry down or warming up) the
    # router checks the sites it knows directly every site_check_interval_s and serves those that pass.
    snapshot_max_age_s: float = 60.0
    site_check_interval_s: float = 2.0
    heartbeat_max_age_s: float = 15.0
    recently_served_s: float = 600.0   # a model served this recently is 503 (retry) while no site is live, not 404
    # Keys and limits.
    require_api_key: bool = True
    api_key_cache_s: float = 30.0
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 32768
    default_max_tokens: int = 0  # max_tokens of requests that send none; 0: up to the model's context
    max_choices: int = 128            # a request's prompts times its `n` (each choice is a generation)
    # Placement and failover.
    max_attempts: int = 3
    first_token_timeout_s: float = 30.0
    token_idle_timeout_s: float = 30.0
    request_timeout_s: float = 600.0
    max_full_wait_s: float = 5.0      # a request with no usable candidate (all full, or none left) waits this long
    failures_to_cool_down: int = 3
    cooldown_s: float = 30.0
    retry_after_s: float = 1.0
    allow_split: bool = True          # False: prefill and decode of a request always on one site
    affinity_slack: float = 0.2       # a new session: candidates within 20% of the best count as near-equal
    session_margin: float = 0.5       # a known session stays on its sites while within 50% of the best score
    max_sessions: int = 100_000       # sessions whose last sites this router remembers
    session_ttl_s: float = 1800.0     # forgotten after this long idle
    expected_output_tokens: int = 128  # the decode horizon the cost model weighs TPOT over
    default_prefill_tokens_per_s: float = 4000.0
    default_decode_tokens_per_s: float = 500.0
    default_kv_bytes_per_token: int = 131072   # until an agent has told the model's own (GetModelInfo)
    decode_step_fixed: float = 32.0   # a decode step's fixed cost in sequences' worth (see router/placement.py)
    decode_seq_kv_bytes: float = float(512 << 20)  # KV bytes read per step costing one sequence's work
    link_max_age_s: float = 300.0      # a measured link older than this gives way to the distance estimate
    # Model -> reasoning parser ("think", "command", an alias such as "deepseek_r1", or "none"); models not
    # named here are detected from their chat template (see router/reasoning.py).
    reasoning_parsers: dict[str, str] = field(default_factory=dict)
    # Model -> tool-call format ("hermes", "llama3_json", "mistral", ... or "none"); models not named here
    # are recognised from their chat template (see router/tool_calls.py).
    tool_call_parsers: dict[str, str] = field(default_factory=dict)

    @property
    def agent_credential(self) -> str:
        """The bearer token sent to agents: agent_token, or peer_token from a configuration of before the split."""
        return self.agent_token or self.peer_token

    def validate(self) -> RouterConfig:
        if self.agent_token and self.peer_token:
            raise ConfigError("peer_token: a router sends agents one token, agent_token; peer_token is its old "
                              "name: remove it")
        try:
            registry_urls(self.registry_url)
        except ValueError as exc:
            raise ConfigError(f"registry_url: {exc}") from None
        for model, parser in self.reasoning_parsers.items():
            if parser not in parser_names():
                raise ConfigError(f"reasoning_parsers.{model}: unknown parser {parser!r}; "
                                  f"known: {', '.join(parser_names())}")
        for model, parser in self.tool_call_parsers.items():
            if parser not in tool_call_parser_names():
                raise ConfigError(f"tool_call_parsers.{model}: unknown tool-call format {parser!r}; "
                                  f"known: {', '.join(tool_call_parser_names())}")
        for name in ("max_attempts", "max_body_bytes", "max_prompt_tokens", "max_choices", "failures_to_cool_down",
                     "expected_output_tokens", "default_kv_bytes_per_token", "max_sessions"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1, got {getattr(self, name)}")
        for name in ("report_interval_s", "snapshot_refresh_s", "snapshot_max_age_s", "site_check_interval_s",
                     "heartbeat_max_age_s",
                     "recently_served_s", "first_token_timeout_s", "token_idle_timeout_s", "request_timeout_s", "retry_after_s",
                     "default_prefill_tokens_per_s", "default_decode_tokens_per_s", "link_max_age_s", "session_ttl_s",
                     "decode_seq_kv_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        for name in ("api_key_cache_s", "cooldown_s", "affinity_slack", "default_max_tokens", "max_full_wait_s",
                     "session_margin", "decode_step_fixed", "placement_report_interval_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must not be negative, got {getattr(self, name)}")
        if self.report_interval_s > GRANT_TTL_S / 2:
            raise ConfigError(f"report_interval_s: at most {GRANT_TTL_S / 2:g} (half a grant's life, "
                              f"{GRANT_TTL_S:g} s), got {self.report_interval_s:g}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: must be in [0, 65535], got {self.port}")
        if self.metrics_listen is not None:
            typed_config.check_listen("metrics_listen", self.metrics_listen)
        for name, limit in (("lat", 90), ("lon", 180)):
            if not -limit <= getattr(self, name) <= limit:
                raise ConfigError(f"{name}: must be in [-{limit}, {limit}], got {getattr(self, name)}")
        self._validate_geo()
        self._validate_tls()
        return self

    def _validate_geo(self) -> None:
        for cidr in self.trusted_proxies:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ConfigError(f"trusted_proxies: {cidr!r} is not an address or CIDR") from None
        headers = {"forwarded_for_header": self.forwarded_for_header}
        if self.location_header:  # "" is none, as geoip_db's
            headers["location_header"] = self.location_header
        for name, header in headers.items():
            if not _HEADER_NAME.fullmatch(header):
                raise ConfigError(f"{name}: {header!r} is not an HTTP header name (such as X-Forwarded-For)")
        if self.location_header and not self.trusted_proxies:
            raise ConfigError("location_header: it is believed only from trusted_proxies, and none are set; "
                              "list the proxies that set it in trusted_proxies")
        if self.geoip_db and not Path(self.geoip_db).is_file():
            raise ConfigError(f"geoip_db: no such file {self.geoip_db!r}")

    def _validate_tls(self) -> None:
        for cert, key in (("tls_cert", "tls_key"), ("agent_client_cert", "agent_client_key")):
            if bool(getattr(self, cert)) != bool(getattr(self, key)):
                raise ConfigError(f"{cert} / {key}: give both or neither")
        if self.metrics_tls and not self.tls_cert:
            raise ConfigError("metrics_tls: HTTPS needs a certificate; set tls_cert and tls_key too")
        if self.agent_client_cert and not self.agent_tls:
            raise ConfigError("agent_client_cert: client certificates need agent_tls = true")
        for name in ("tls_cert", "tls_key", "tls_ca", "agent_client_cert", "agent_client_key"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"{name}: no such file {path!r}")
        try:
            if self.tls_ca:
                check_bundle("tls_ca", self.tls_ca)
            for cert, key in (("tls_cert", "tls_key"), ("agent_client_cert", "agent_client_key")):
                if getattr(self, cert):
                    check_identity(cert, getattr(self, cert), key, getattr(self, key))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def config_from_dict(values: dict, where: str = "router config") -> RouterConfig:
    """A RouterConfig from a `[router]` table's values: unknown keys and ill-typed values are refused."""
    return typed_config.build(RouterConfig, typed_config.check_values(RouterConfig, values, where), where)


def load_config(path: str | Path, overrides: dict | None = None) -> RouterConfig:
    """The `[router]` table of a TOML file (or its top-level keys), then `overrides` (flags)."""
    return typed_config.load(RouterConfig, path, table="router", overrides=overrides)
