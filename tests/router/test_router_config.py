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
