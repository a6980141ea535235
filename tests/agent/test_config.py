"""One config loader: TOML, then environment, then flags; bad settings name the field."""

from __future__ import annotations

import re

import pytest

from deploy.cli import build_parser
from node_agent.auth import token_digest
from node_agent.cli import overrides_from_args
from node_agent.config import ConfigError, load_config


def write(tmp_path, text: str):
    path = tmp_path / "site.toml"
    path.write_text(text)
    return path


def site_toml(model_dir, extra: str = "") -> str:
    return f'''
site = "fra-1"
region = "eu-west"
lon = 8.7
peer_token = "s3cret"
kv_cache_bytes = 8388608
[models]
tiny = "{model_dir}"
''' .replace("[models]", extra + "\n[models]")


def test_toml_env_and_flags_layer(tmp_path, tiny_model_dir):
    path = write(tmp_path, site_toml(tiny_model_dir, 'lat = 50\nrole = "prefill"'))
    config = load_config(path, environ={})
    assert (config.site, config.region, config.lat, config.role) == ("fra-1", "eu-west", 50.0, "prefill")
    assert config.models == {"tiny": str(tiny_model_dir)} and config.kv_cache_bytes == 8 << 20

    env = {"EDGEFIRE_AGENT_KV_CACHE_BYTES": "1024", "EDGEFIRE_AGENT_REGION": "eu-north",
           "EDGEFIRE_AGENT_MODELS": f"other={tiny_model_dir}"}
    config = load_config(path, environ=env)
    assert (config.kv_cache_bytes, config.region, list(config.models)) == (1024, "eu-north", ["other"])

    args = build_parser().parse_args(["agent", "--config", str(path), "--region", "us-east", "--lat", "40.7",
                                      "--model", f"flagged={tiny_model_dir}", "--metrics-listen", "none"])
    config = load_config(args.config, overrides_from_args(args), environ=env)
    assert (config.region, config.lat, list(config.models), config.metrics_listen) == \
        ("us-east", 40.7, ["flagged"], None)
    assert args.func.__module__ == "node_agent.cli"


@pytest.mark.parametrize("extra, words", [
    ('colour = "blue"', "colour: unknown setting"),
    ('max_num_seqs = "lots"', "max_num_seqs: must be int, got str"),
    ("heartbeat_interval_s = true", "heartbeat_interval_s: must be float, got bool"),
    ('role = "router"', "role: must be one of prefill, decode, both"),
    ('weight_mode = "lazy"', "weight_mode: must be one of decompress_on_load, compressed_in_memory"),
    ("expert_parallel_size = 0", "expert_parallel_size: must be >= 1, got 0"),
    ("lat = 123.0", "lat: must be in [-90, 90]"),
    ('registry_url = "http://registry:8500"', "site_token: required when registry_url is set"),
    ('tls_cert = "/nope/cert.pem"', "tls_cert / tls_key: give both or neither"),
    ('registry_url = ["http://a:8500", "ftp://b"]\nsite_token = "t"', "registry_url: registry URL 'ftp://b' must start"),
    ('speculative_method = "medusa"', "speculative_method: must be one of ngram, draft"),
    ('speculative_method = "ngram"\nspeculative_tokens = 0', "speculative_tokens: must be in [1, 16]"),
    ('speculative_method = "draft"', "speculative_draft_model: give it exactly when"),
    ('speculative_method = "draft"\nspeculative_draft_model = "/no/draft"', "'/no/draft' is not a checkpoint"),
    # What the registry refuses at registration (the agent served, never registered, and retried forever).
    ('country = "Germany"', "country: country 'Germany' must be an ISO 3166-1 alpha-2 code"),
    ('grpc_listen = "nope"', "grpc_listen: expected host:port such as 127.0.0.1:9401, got 'nope'"),
    ('metrics_listen = "0.0.0.0:70000"',
     "metrics_listen: expected host:port such as 127.0.0.1:9401, got '0.0.0.0:70000'"),
    ("kv_data_port = 70000", "kv_data_port: must be a port in [0, 65535] (0: any free port), got 70000"),
    ("heartbeat_interval_s = 7200.0", "heartbeat_interval_s: heartbeat_interval_s must be in (0, 3600]"),
    ('advertise_address = "fra-1.example.net"',
     "advertise_address: grpc_address 'fra-1.example.net' must be 'host:port'"),
])
def test_bad_settings_name_the_field(tmp_path, tiny_model_dir, extra, words):
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, site_toml(tiny_model_dir, extra)), environ={})
    assert words in str(error.value)


@pytest.mark.parametrize("setting, value, words", [
    ("site", "Frankfurt_1", "site: site name 'Frankfurt_1' must be 1-63 characters of a-z, 0-9 and '-'"),
    ("region", "EU West", "region: region 'EU West' must be 1-63 characters of a-z, 0-9 and '-'"),
])
def test_a_site_name_or_region_the_registry_refuses_is_refused_at_start(tmp_path, tiny_model_dir, setting, value,
                                                                         words):
    text = site_toml(tiny_model_dir).replace(f'{setting} = "', f'{setting} = "{value}"  # was "', 1)
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, text), environ={})
    assert words in str(error.value)


def test_missing_model_dir_and_bad_env(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"models.tiny: '/no/such/dir' is not a checkpoint directory"):
        load_config(write(tmp_path, site_toml("/no/such/dir")), environ={})
    with pytest.raises(ConfigError, match="EDGEFIRE_AGENT_MAX_WAITING: must be int, got 'many'"):
        load_config(write(tmp_path, site_toml(tiny_model_dir)), environ={"EDGEFIRE_AGENT_MAX_WAITING": "many"})
    with pytest.raises(ConfigError, match="absent.toml: no such config file"):
        load_config(tmp_path / "absent.toml", environ={})


def test_missing_required_site_and_bad_flags_are_named(tmp_path, tiny_model_dir):
    text = site_toml(tiny_model_dir).replace('site = "fra-1"\n', "")
    with pytest.raises(ConfigError, match=r"site.toml: missing required setting\(s\): site"):
        load_config(write(tmp_path, text), environ={})
    path = write(tmp_path, site_toml(tiny_model_dir))
    args = build_parser().parse_args(["agent", "--config", str(path), "--max-num-seqs", "lots"])
    with pytest.raises(ConfigError, match="--max-num-seqs: must be int, got 'lots'"):
        load_config(args.config, overrides_from_args(args), environ={})
    with pytest.raises(ConfigError, match="EDGEFIRE_AGENT_LAT: must be a finite number"):
        load_config(path, environ={"EDGEFIRE_AGENT_LAT": "nan"})


def test_several_registry_replicas_from_file_or_environment(tmp_path, tiny_model_dir):
    path = write(tmp_path, site_toml(tiny_model_dir, 'registry_url = ["http://a:8500", "http://b:8500"]\n'
                                                     'site_token = "t"'))
    assert load_config(path, environ={}).registry_url == ["http://a:8500", "http://b:8500"]
    env = {"EDGEFIRE_AGENT_REGISTRY_URL": "http://c:8500,http://d:8500"}
    assert load_config(path, environ=env).registry_url == ["http://c:8500", "http://d:8500"]
    env = {"EDGEFIRE_AGENT_REGISTRY_URL": "http://c:8500"}
    assert load_config(path, environ=env).registry_url == "http://c:8500"


def test_parallel_sizes_reach_the_engine_config(tmp_path, tiny_model_dir):
    from node_agent.models import engine_config

    text = site_toml(tiny_model_dir, "tensor_parallel_size = 2\npipeline_parallel_size = 2")
    config = engine_config(load_config(write(tmp_path, text), environ={}))
    assert (config.tensor_parallel_size, config.pipeline_parallel_size, config.expert_parallel_size) == (2, 2, 1)


def test_speculative_settings_reach_the_engine(tmp_path, tiny_model_dir):
    from node_agent.models import engine_config

    extra = f'speculative_method = "draft"\nspeculative_tokens = 5\nspeculative_draft_model = "{tiny_model_dir}"'
    spec = engine_config(load_config(write(tmp_path, site_toml(tiny_model_dir, extra)), environ={})).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.draft_model) == ("draft", 5, str(tiny_model_dir))
    assert engine_config(load_config(write(tmp_path, site_toml(tiny_model_dir)), environ={})).speculative is None


def test_the_agent_token_digest_comes_from_file_or_environment(tmp_path, tiny_model_dir):
    digest = token_digest("efag-router")
    config = load_config(write(tmp_path, site_toml(tiny_model_dir, f'agent_token_sha256 = "{digest}"')), environ={})
    assert config.agent_token_sha256 == digest
    config = load_config(write(tmp_path, site_toml(tiny_model_dir)),
                         environ={"EDGEFIRE_AGENT_AGENT_TOKEN_SHA256": digest.upper()})
    assert config.agent_token_sha256 == digest.upper()
    assert load_config(write(tmp_path, site_toml(tiny_model_dir)), environ={}).agent_token_sha256 == ""


@pytest.mark.parametrize("value, words", [
    # the peer token's own digest: one token would open both roles again
    (token_digest("s3cret"), "agent_token_sha256: it is the digest of peer_token"),
    (token_digest("s3cret").upper(), "agent_token_sha256: it is the digest of peer_token"),
    ("efag-router", "agent_token_sha256: must be the SHA-256 of the routers' agent_token as 64 hex digits"),
    ("z" * 64, "not the token itself"),
])
def test_a_bad_agent_token_digest_is_refused_at_start(tmp_path, tiny_model_dir, value, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(write(tmp_path, site_toml(tiny_model_dir, f'agent_token_sha256 = "{value}"')), environ={})


def test_several_agent_token_digests_and_peer_tokens_from_file_or_environment(tmp_path, tiny_model_dir):
    """A rotation's settings: a list in TOML, comma-separated in the environment; one string stays valid."""
    old, new = token_digest("efag-old"), token_digest("efag-new")
    extra = f'agent_token_sha256 = ["{old}", "{new.upper()}"]\naccept_peer_tokens = ["old-peer"]'
    config = load_config(write(tmp_path, site_toml(tiny_model_dir, extra)), environ={})
    assert config.agent_token_digests == [old, new] and config.accept_peer_tokens == ["old-peer"]
    env = {"EDGEFIRE_AGENT_AGENT_TOKEN_SHA256": f"{old},{new}", "EDGEFIRE_AGENT_ACCEPT_PEER_TOKENS": "p1,p2"}
    config = load_config(write(tmp_path, site_toml(tiny_model_dir)), environ=env)
    assert config.agent_token_digests == [old, new] and config.accept_peer_tokens == ["p1", "p2"]
    config = load_config(write(tmp_path, site_toml(tiny_model_dir)), environ={"EDGEFIRE_AGENT_AGENT_TOKEN_SHA256": old})
    assert config.agent_token_digests == [old] and config.accept_peer_tokens == []
    assert load_config(write(tmp_path, site_toml(tiny_model_dir)), environ={}).agent_token_digests == []


@pytest.mark.parametrize("extra, words", [
    (f'agent_token_sha256 = ["{token_digest("a")}", "efag-router"]',
     "agent_token_sha256[1]: must be the SHA-256 of the routers' agent_token as 64 hex digits"),
    (f'agent_token_sha256 = ["{token_digest("a")}", ""]', "agent_token_sha256[1]: must be the SHA-256"),
    (f'agent_token_sha256 = ["{token_digest("a")}", "{token_digest("s3cret")}"]',
     "agent_token_sha256[1]: it is the digest of peer_token"),
    # a peer token accepted from peers must no more be an agent token than the one sent
    (f'agent_token_sha256 = "{token_digest("old-peer")}"\naccept_peer_tokens = ["old-peer"]',
     "agent_token_sha256: it is the digest of accept_peer_tokens[0]"),
    ('accept_peer_tokens = ["ok", ""]', "accept_peer_tokens[1]: a peer token must be non-empty"),
    ('accept_peer_tokens = [" old-peer"]', "accept_peer_tokens[0]: a peer token must be non-empty, without spaces"),
    ('accept_peer_tokens = "old-peer"', "accept_peer_tokens: must be a list of str"),
])
def test_bad_rotation_settings_are_refused_at_start(tmp_path, tiny_model_dir, extra, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(write(tmp_path, site_toml(tiny_model_dir, extra)), environ={})
