"""The router's configuration: one dataclass, loaded from TOML (a `[router]` table or top-level keys).

Unknown keys are refused so a misspelt setting fails at start rather than silently keeping a default.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """The configuration file is unreadable or names an unknown or ill-typed setting."""


@dataclass(slots=True)
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    registry_url: str = "http://127.0.0.1:8500"
    registry_token: str = ""          # the registry's router token
    peer_token: str = ""              # bearer token sent to agents
    # Where this router stands: the location of clients we cannot place (anycast puts them near us).
    lat: float = 0.0
    lon: float = 0.0
    site: str | None = None           # the site this router runs beside: its measured links give client RTTs
    geoip_db: str | None = None       # GeoIP2/GeoLite2 City .mmdb; reloaded on SIGHUP
    location_header: str | None = None        # "lat,lon" set by a trusted front proxy
    forwarded_for_header: str = "x-forwarded-for"
    trusted_proxies: list[str] = field(default_factory=list)  # CIDRs whose headers we believe
    # Registry snapshot.
    snapshot_refresh_s: float = 1.0
    snapshot_max_age_s: float = 60.0  # last-known-good is served this long while the registry is down
    snapshot_fail_open: bool = False  # past max age: keep serving the stale snapshot (open) or 503 (closed)
    heartbeat_max_age_s: float = 15.0
    # Keys and limits.
    require_api_key: bool = True
    api_key_cache_s: float = 30.0
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 32768
    default_max_tokens: int = 256
    # Placement and failover.
    max_attempts: int = 3
    first_token_timeout_s: float = 30.0
    token_idle_timeout_s: float = 30.0
    request_timeout_s: float = 600.0
    failures_to_cool_down: int = 3
    cooldown_s: float = 30.0
    retry_after_s: float = 1.0
    affinity_slack: float = 0.2       # candidates within 20% of the best count as near-equal for affinity
    expected_output_tokens: int = 128  # the decode horizon the cost model weighs TPOT over
    default_prefill_tokens_per_s: float = 4000.0
    default_decode_tokens_per_s: float = 500.0
    default_kv_bytes_per_token: int = 131072
    link_max_age_s: float = 300.0      # a measured link older than this gives way to the distance estimate

    def validate(self) -> RouterConfig:
        if self.max_attempts < 1:
            raise ConfigError("max_attempts must be at least 1")
        for name in ("snapshot_refresh_s", "first_token_timeout_s", "token_idle_timeout_s", "request_timeout_s",
                     "link_max_age_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if not -90 <= self.lat <= 90 or not -180 <= self.lon <= 180:
            raise ConfigError("lat must be within [-90, 90] and lon within [-180, 180]")
        return self


def config_from_dict(values: dict) -> RouterConfig:
    known = {f.name: f for f in dataclasses.fields(RouterConfig)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown router setting(s): {', '.join(unknown)}")
    try:
        return RouterConfig(**values).validate()
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc


def load_config(path: str | Path, overrides: dict | None = None) -> RouterConfig:
    try:
        document = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    values = document.get("router", document)
    return config_from_dict({**values, **(overrides or {})})
