"""The agent's configuration: one dataclass, one loader (TOML file, then environment, then flags).

Every field can be set three ways, later ones winning: the TOML file, an `EDGEFIRE_AGENT_<FIELD>`
environment variable, and a `--<field-with-dashes>` flag. Models are a TOML table
`[models] name = "/checkpoint/dir"`, `EDGEFIRE_AGENT_MODELS="a=/x,b=/y"` or repeated `--model a=/x`.
A model whose parallel sizes differ from the agent-wide ones names its own in `[model_parallel]`
(`name = "tp=1 ep=4"`, or `EDGEFIRE_AGENT_MODEL_PARALLEL="name=tp=1 ep=4"`): a dense model and a
mixture of experts on one site, the experts split across ranks and the dense model on one.
Loading and type checks are `typed_config`'s (shared with the router): a bad value is a ConfigError
that names the file (or variable, or flag), the field and what to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import typed_config
from engine.compression import WEIGHT_MODES
from engine.config import load_config as load_model_config
from engine.errors import EngineError
from engine.parallel.layout import ParallelLayout
from engine.speculative_config import MAX_SPECULATIVE_TOKENS, METHODS, SpeculativeConfig, check_draft_model
from node_agent.auth import token_digest
from node_agent.tls import check_bundle, check_identity
from registry import validate as registry_rules
from registry.client import registry_urls
from registry.errors import InvalidInput
from registry.records import SiteSpec
from typed_config import ConfigError

ENV_PREFIX = "EDGEFIRE_AGENT_"
MIN_THROUGHPUT_BYTES = 16 << 10  # a smaller transfer measures latency, not throughput (node_agent.links)
MAX_PROBE_BYTES = 1 << 20        # the most a KV data port sends to one link probe
ROLES = ("prefill", "decode", "both")
# A model's own parallel sizes (model_parallel) by their short names, as ParallelLayout prints them.
PARALLEL_SIZES = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "ep": "expert_parallel_size"}


@dataclass(slots=True)
class AgentConfig:
    site: str                                   # required
    region: str | None = None
    country: str | None = None
    lat: float | None = None
    lon: float | None = None
    role: str = "both"                          # prefill | decode | both
    models: dict[str, str] = field(default_factory=dict)  # model name -> checkpoint dir
    grpc_listen: str = "127.0.0.1:50051"
    advertise_address: str | None = None        # what the registry tells routers; default grpc_listen
    metrics_listen: str | None = "127.0.0.1:9400"  # None: no metrics endpoint
    # None: run without a registry. Several replicas: a list (or comma-separated), tried in order on failure.
    registry_url: str | list[str] | None = None
    site_token: str | None = None
    # Agent gRPC credentials by caller role (node_agent.auth). peer_token: agents present it to each other
    # (FetchKV, the KV data port); this agent sends it to its peers. agent_token_sha256: the SHA-256 (64 hex
    # digits) of the agent token, which routers present (their agent_token) for Generate, Prefill, Decode,
    # GetModelInfo and Drain; the agent only checks it, so it holds no more than its digest. Health and
    # ReleaseKV take either. Empty agent_token_sha256: the peer token opens every method (one token for both
    # roles, as before the split; a warning at start says how to split).
    # Rotation (deploy/README.md, Tokens): agent_token_sha256 may list several digests (comma-separated in
    # the environment), each accepted, while routers switch tokens; accept_peer_tokens are peer tokens
    # accepted beside peer_token and never sent, while peers switch. Both are logged at start.
    peer_token: str = ""
    agent_token_sha256: str | list[str] = ""
    accept_peer_tokens: list[str] = field(default_factory=list)
    # TLS: with tls_cert/tls_key the gRPC port and the KV data port speak only TLS, and peers are called
    # over TLS too (presenting this certificate, for peers that demand client certificates).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None                   # CA bundle verifying peers and an https registry (None: system roots)
    tls_client_ca: str | None = None            # callers (routers, peers) must present a certificate signed by it
    metrics_tls: bool = False                   # serve /metrics over HTTPS with tls_cert (scrapers need no certificate)
    kv_cache_bytes: int = 256 << 20             # KV pool per model
    kv_lease_ttl_s: float = 30.0
    kv_chunk_bytes: int = 1 << 20
    kv_data_port: int | None = 0                # raw TCP port for KV bytes (0: any free port; None: off, use FetchKV)
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_waiting: int = 64                       # queued requests beyond which new work is refused
    device: str = "auto"
    dtype: str = "auto"
    # Compressed checkpoints (edgefire compress): decompress_on_load, or compressed_in_memory (MLP weights
    # stay compressed, decoded layer by layer; the memory saved goes to the KV cache).
    weight_mode: str = "decompress_on_load"
    tensor_parallel_size: int = 1               # each model on this many ranks per pipeline stage (one device each)
    pipeline_parallel_size: int = 1             # each model's layers in this many stages
    expert_parallel_size: int = 1               # a mixture of experts' experts split across this many ranks per stage
    # model name -> its own sizes ("tp=1 ep=4"; tp, pp, ep); a size it leaves out is the agent-wide one above
    model_parallel: dict[str, str] = field(default_factory=dict)
    # Speculative decoding (engine.speculative): ngram (prompt lookup) or draft (a smaller checkpoint with the
    # same tokenizer, speculative_draft_model); None: off. Requests may opt out (no_speculation).
    speculative_method: str | None = None
    speculative_tokens: int = 3                 # k: the most tokens proposed per sequence per step
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 4
    speculative_draft_model: str | None = None  # the draft checkpoint's directory (method draft)
    heartbeat_interval_s: float = 2.0
    drain_timeout_s: float = 30.0
    fetch_timeout_s: float = 30.0               # a KV pull slower than this falls back to recompute
    link_probe_interval_s: float = 60.0         # a peer path quiet this long gets one probe; 0: never probe
    link_probe_bytes: int = 256 << 10
    link_report_interval_s: float = 10.0        # measured links go to the registry this often

    def _validate_speculative(self) -> None:
        method, draft = self.speculative_method, self.speculative_draft_model
        if method is not None and method not in METHODS:
            raise ConfigError(f"speculative_method: must be one of {', '.join(METHODS)}, got {method!r}")
        if not 1 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"speculative_tokens: must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.speculative_tokens}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"speculative_ngram_min / speculative_ngram_max: need 1 <= min <= max <= "
                              f"{MAX_SPECULATIVE_TOKENS}, got {self.speculative_ngram_min} and {self.speculative_ngram_max}")
        if (method == "draft") != bool(draft):
            raise ConfigError("speculative_draft_model: give it exactly when speculative_method is \"draft\"")
        if draft and not (Path(draft) / "config.json").is_file():
            raise ConfigError(f"speculative_draft_model: {draft!r} is not a checkpoint directory (no config.json)")
        if draft:  # one draft serves every model of the site: each must share its tokenizer
            for name, path in self.models.items():
                try:
                    check_draft_model(draft, path)
                except (EngineError, ValueError) as exc:
                    raise ConfigError(f"speculative_draft_model: cannot draft for models.{name}: {exc}") from None
        if method is None:
            return
        for name in self.models:  # speculation is the site's, every model's engine runs it
            layout = self.layout_of(name)
            if layout.pp > 1:
                raise ConfigError(f"speculative_method: speculative decoding does not run with pipeline_parallel_size "
                                  f"> 1 ({self._sizes_setting(name)}: {layout})")
            if method == "draft" and layout.world_size > 1:
                raise ConfigError(f"speculative_method: a draft model runs in one process, not with {layout} "
                                  f"({self._sizes_setting(name)}); use \"ngram\" with tensor or expert parallelism, "
                                  f"or a single-rank engine")

    def layout_of(self, model: str | None) -> ParallelLayout:
        """The model's parallel sizes: its own in model_parallel, the agent-wide ones for the sizes it leaves
        out (all of them for a model without its own, or None)."""
        own = self.model_parallel.get(model)
        sizes = {"tp": self.tensor_parallel_size, "pp": self.pipeline_parallel_size, "ep": self.expert_parallel_size}
        if own is not None:
            sizes.update(parse_parallel_sizes(own, f"model_parallel.{model}"))
        return ParallelLayout(sizes["tp"], sizes["pp"], sizes["ep"])

    def _sizes_setting(self, model: str) -> str:
        """The setting that gives the model its sizes, for messages: where to change them."""
        return f"model_parallel.{model}" if model in self.model_parallel else f"models.{model}"

    def _validate_parallel(self) -> None:
        """Each model's parallel sizes against its config.json, refused at start like any other bad
        setting: the engine would otherwise refuse them while loading, as a traceback out of the agent."""
        for name in self.model_parallel:
            if name not in self.models:
                raise ConfigError(f"model_parallel.{name}: no such model in models (models: "
                                  f"{', '.join(self.models)})")
        for name, path in self.models.items():
            layout = self.layout_of(name)
            try:
                layout.validate()
                layout.check_model(load_model_config(path))
            except (EngineError, ValueError) as exc:
                raise ConfigError(f"{self._sizes_setting(name)}: {exc}") from None

    def speculative_config(self) -> SpeculativeConfig | None:
        if self.speculative_method is None:
            return None
        return SpeculativeConfig(self.speculative_method, self.speculative_tokens, self.speculative_ngram_min,
                                 self.speculative_ngram_max, self.speculative_draft_model)

    @property
    def grpc_address(self) -> str:
        return self.advertise_address or self.grpc_listen

    @property
    def peers_over_tls(self) -> bool:
        """A site with a certificate (or a CA to check others by) expects its peers to speak TLS too."""
        return bool(self.tls_cert or self.tls_ca)

    def _validate_registration(self) -> None:
        """What the registry would refuse at registration, refused at start instead: the agent would
        otherwise serve, never register and retry the same 422 forever. (lat or lon alone is fine:
        registration keeps the other's stored value.)"""
        checks = [("site", lambda: registry_rules.site_name(self.site)),
                  ("region", lambda: registry_rules.site_spec(SiteSpec(region=self.region))),
                  ("country", lambda: registry_rules.site_spec(SiteSpec(country=self.country))),
                  ("heartbeat_interval_s", lambda: registry_rules.heartbeat_interval(self.heartbeat_interval_s))]
        if self.advertise_address is not None:
            checks.append(("advertise_address", lambda: registry_rules.grpc_address(self.advertise_address)))
        for name, check in checks:
            try:
                check()
            except InvalidInput as exc:
                raise ConfigError(f"{name}: {exc.message}") from None

    @property
    def agent_token_digests(self) -> list[str]:
        """The accepted agent token digests, lowercase, each once (empty: not split)."""
        digests = [self.agent_token_sha256] if isinstance(self.agent_token_sha256, str) else self.agent_token_sha256
        return list(dict.fromkeys(digest.lower() for digest in digests if digest))

    def _digest_settings(self) -> list[tuple[str, str]]:
        """(the setting's name for messages, digest) for each agent token digest given."""
        if isinstance(self.agent_token_sha256, str):
            return [("agent_token_sha256", self.agent_token_sha256)] if self.agent_token_sha256 else []
        return [(f"agent_token_sha256[{i}]", digest) for i, digest in enumerate(self.agent_token_sha256)]

    def _peer_token_settings(self) -> list[tuple[str, str]]:
        """(the setting's name for messages, token) for each peer token accepted."""
        return [("peer_token", self.peer_token),
                *((f"accept_peer_tokens[{i}]", token) for i, token in enumerate(self.accept_peer_tokens))]

    def _validate_tokens(self) -> None:
        if not self.peer_token:
            raise ConfigError("peer_token: the token agents present to each other is required")
        for name, token in self._peer_token_settings()[1:]:
            if not token or token != token.strip():
                raise ConfigError(f"{name}: a peer token must be non-empty, without spaces around it (a caller's "
                                  f"token is read with its surrounding spaces dropped), got {len(token)} characters")
        peer_digests = {token_digest(token): name for name, token in self._peer_token_settings()}
        for name, digest in self._digest_settings():
            if len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest):
                raise ConfigError(f"{name}: must be the SHA-256 of the routers' agent_token as 64 hex digits "
                                  "(printf %s TOKEN | sha256sum), not the token itself")
            if digest.lower() in peer_digests:
                raise ConfigError(f"{name}: it is the digest of {peer_digests[digest.lower()]}; the routers' "
                                  "agent_token must differ from every peer token this agent accepts (one token "
                                  "would open the router methods to every site again): give routers a token of "
                                  "their own, or leave agent_token_sha256 out")

    def validate(self) -> None:
        if not self.site:
            raise ConfigError("site: the site name must not be empty")
        self._validate_registration()
        if self.role not in ROLES:
            raise ConfigError(f"role: must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.models:
            raise ConfigError("models: at least one model (name = checkpoint dir) is required")
        for name, path in self.models.items():
            if not (Path(path) / "config.json").is_file():
                raise ConfigError(f"models.{name}: {path!r} is not a checkpoint directory (no config.json)")
        self._validate_tokens()
        if self.registry_url and not self.site_token:
            raise ConfigError("site_token: required when registry_url is set")
        if self.registry_url:
            try:
                registry_urls(self.registry_url)
            except ValueError as exc:
                raise ConfigError(f"registry_url: {exc}") from None
        typed_config.check_listen("grpc_listen", self.grpc_listen)
        if self.metrics_listen is not None:
            typed_config.check_listen("metrics_listen", self.metrics_listen)
        if self.kv_data_port is not None and not 0 <= self.kv_data_port <= 65535:
            raise ConfigError(f"kv_data_port: must be a port in [0, 65535] (0: any free port), got {self.kv_data_port}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert / tls_key: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("tls_client_ca: client certificates need TLS; set tls_cert and tls_key too")
        if self.metrics_tls and not self.tls_cert:
            raise ConfigError("metrics_tls: HTTPS needs a certificate; set tls_cert and tls_key too")
        for name in ("tls_cert", "tls_key", "tls_ca", "tls_client_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"{name}: no such file {path!r}")
        try:
            for name in ("tls_ca", "tls_client_ca"):
                if getattr(self, name):
                    check_bundle(name, getattr(self, name))
            if self.tls_cert:
                check_identity("tls_cert", self.tls_cert, "tls_key", self.tls_key)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for name in ("kv_cache_bytes", "kv_chunk_bytes", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        self._validate_parallel()
        if self.weight_mode not in WEIGHT_MODES:
            raise ConfigError(f"weight_mode: must be one of {', '.join(WEIGHT_MODES)}, got {self.weight_mode!r}")
        self._validate_speculative()
        if self.max_waiting < 0:
            raise ConfigError(f"max_waiting: must be >= 0, got {self.max_waiting}")
        if not MIN_THROUGHPUT_BYTES <= self.link_probe_bytes <= MAX_PROBE_BYTES:
            raise ConfigError(f"link_probe_bytes: must be in [{MIN_THROUGHPUT_BYTES}, {MAX_PROBE_BYTES}], "
                              f"got {self.link_probe_bytes}")
        if self.link_probe_interval_s < 0:
            raise ConfigError(f"link_probe_interval_s: must be >= 0 (0: never probe), got {self.link_probe_interval_s}")
        for name in ("kv_lease_ttl_s", "heartbeat_interval_s", "drain_timeout_s", "fetch_timeout_s",
                     "link_report_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name, limit in (("lat", 90), ("lon", 180)):
            value = getattr(self, name)
            if value is not None and not -limit <= value <= limit:
                raise ConfigError(f"{name}: must be in [-{limit}, {limit}], got {value}")


def parse_parallel_sizes(text: str, where: str) -> dict[str, int]:
    """A model's own sizes, "tp=1 ep=4" (tp, pp and ep, space-separated, each at most once): {"tp": 1, "ep": 4}."""
    sizes: dict[str, int] = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep or key not in PARALLEL_SIZES:
            raise ConfigError(f"{where}: expected sizes such as \"tp=1 ep=4\" (tp, pp and ep, space-separated), "
                              f"got {text!r}")
        if key in sizes:
            raise ConfigError(f"{where}: {key} is given twice in {text!r}")
        if not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise ConfigError(f"{where}: {key} ({PARALLEL_SIZES[key]}) must be an integer >= 1, got {value!r}")
        sizes[key] = int(value)
    if not sizes:
        raise ConfigError(f"{where}: expected sizes such as \"tp=1 ep=4\" (tp, pp and ep), got {text!r}")
    return sizes


FIELDS = typed_config.fields_of(AgentConfig)


def base_type(name: str) -> type:
    """The field's type without `| None` (dict for models)."""
    return typed_config.base_type(AgentConfig, name)


def parse_text(name: str, text: str, where: str | None = None):
    """A value from the environment or a flag: text converted to the field's type."""
    return typed_config.parse_text(AgentConfig, name, text, where or name)


def parse_models(items: list[str], where: str = "models") -> dict[str, str]:
    """NAME=CHECKPOINT_DIR items (repeated `--model`) as the models table."""
    return typed_config.parse_pairs(items, where)


def load_config(path: str | Path | None = None, overrides: dict | None = None,
                environ: dict[str, str] | None = None) -> AgentConfig:
    """File, then environment, then `overrides` (typed values of the settings given as flags)."""
    return typed_config.load(AgentConfig, path, env_prefix=ENV_PREFIX, environ=environ, overrides=overrides)
