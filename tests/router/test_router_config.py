"""The router's TOML configuration and its command line."""

from __future__ import annotations

import argparse

import pytest

from router.cli import add_parser
from router.config import ConfigError, load_config


def test_config_loads_router_table_and_refuses_unknown_keys(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text('[router]\nport = 9000\nlat = 48.8\nlon = 2.3\ntrusted_proxies = ["10.0.0.0/8"]\n')
    config = load_config(path, {"registry_url": "http://r:8500"})
    assert (config.port, config.lat, config.trusted_proxies, config.registry_url) == (
        9000, 48.8, ["10.0.0.0/8"], "http://r:8500")
    path.write_text('[router]\nprot = 9000\n')
    with pytest.raises(ConfigError, match="prot"):
        load_config(path)


def test_cli_adds_router_subcommand(tmp_path):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    path = tmp_path / "bad.toml"
    path.write_text("max_attempts = 0\n")
    args = parser.parse_args(["router", "--config", str(path), "--port", "1"])
    assert args.func(args) == 2  # refused with a clear error, before any server starts


@pytest.mark.parametrize("text, words", [
    # A string where a number belongs used to load and fail later with "'<' not supported".
    ('[router]\nmax_attempts = "3"\n', "max_attempts: must be int, got str '3'"),
    ('[router]\nlat = "48.8"\n', "lat: must be float, got str '48.8'"),
    ('[router]\nrequire_api_key = "no"\n', "require_api_key: must be bool, got str 'no'"),
    ('[router]\ntrusted_proxies = "10.0.0.0/8"\n', "trusted_proxies: must be a list of str"),
    ('[router]\ntrusted_proxies = ["10.0.0.0/8", 7]\n', r"trusted_proxies\[1\]: must be str, got int 7"),
    ('[router]\nsnapshot_refresh_s = nan\n', "snapshot_refresh_s: must be a finite number"),
    ('[router]\nprot = 9000\n', "prot: unknown setting"),
    ('[router]\nport = 9000\n[extra]\nx = 1\n', r"extra: unknown setting\(s\) outside the \[router\] table"),
    ('[router]\ncooldown_s = -1\n', "cooldown_s: must not be negative"),
    ('[router]\ntrusted_proxies = ["10.0.0.0/33"]\n', "trusted_proxies: '10.0.0.0/33' is not an address or CIDR"),
    # A location header only a trusted proxy may set, with no proxy trusted, was silently never read.
    ('[router]\nlocation_header = "x-client-location"\n', "location_header: it is believed only from trusted_proxies"),
    ('[router]\nforwarded_for_header = ""\n', "forwarded_for_header: '' is not an HTTP header name"),
    ('[router]\nforwarded_for_header = "X-Forwarded-For:"\n', "forwarded_for_header: 'X-Forwarded-For:' is not an HTTP"),
    ('[router]\ngeoip_db = "/nonexistent/GeoLite2-City.mmdb"\n', "geoip_db: no such file '/nonexistent/GeoLite2-City.mmdb'"),
    ('[router\n', "not valid TOML"),
])
def test_bad_settings_fail_at_load_naming_file_key_and_type(tmp_path, text, words):
    path = tmp_path / "router.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words) as error:
        load_config(path)
    assert str(error.value).startswith(str(path))


def test_flags_are_type_checked_like_the_file(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text("[router]\n")
    with pytest.raises(ConfigError, match="--port: must be int, got str '80'"):
        load_config(path, {"port": "80"})
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.toml")


def test_registry_url_takes_one_url_or_several_replicas(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text('[router]\nregistry_url = ["http://registry-a:8500", "http://registry-b:8500"]\n')
    assert load_config(path).registry_url == ["http://registry-a:8500", "http://registry-b:8500"]
    assert load_config(path, {"registry_url": "http://a:8500,http://b:8500"}).registry_url == "http://a:8500,http://b:8500"
    path.write_text('[router]\nregistry_url = ["http://registry-a:8500", "registry-b:8500"]\n')
    with pytest.raises(ConfigError, match="registry_url: registry URL 'registry-b:8500' must start with http"):
        load_config(path)
    path.write_text('[router]\nregistry_url = 8500\n')
    with pytest.raises(ConfigError, match="registry_url: must be str or a list of str, got int 8500"):
        load_config(path)
