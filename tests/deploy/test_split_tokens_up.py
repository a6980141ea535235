"""`edgefire up`'s tokens are split by role: routers present the agent token, agents present the peer
token to each other, the two are distinct, and agents hold the agent token's digest, not the token
(node_agent.auth). A cluster running on them (a split request, the peer token refused on a router's
methods) is checked on the end-to-end cluster: tests/e2e/test_02_placement.py."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from deploy.cluster_config import ClusterConfig, ClusterConfigError, SiteSpec, load_cluster_toml
from node_agent.auth import token_digest

PREFILL_ONLY, DECODE_ONLY = "lisbon", "frankfurt"
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
TOKENS = ("admin_token", "router_token", "agent_token", "peer_token")


def two_sites() -> list[SiteSpec]:
    return [SiteSpec(PREFILL_ONLY, "eu-west", "PT", 38.72, -9.14, "prefill"),
            SiteSpec(DECODE_ONLY, "eu-central", "DE", 50.11, 8.68, "decode")]


def test_the_example_configs_and_secrets_split_the_tokens_and_agree_on_the_agent_token():
    """The examples an operator copies run split: the routers' agent_token is what the agents hold the
    digest of, and no example hands a router the peer token."""
    router = tomllib.loads((DEPLOY / "config" / "router.toml").read_text())["router"]
    agent = tomllib.loads((DEPLOY / "config" / "agent.toml").read_text())
    assert "peer_token" not in router and agent["agent_token_sha256"] == token_digest(router["agent_token"])
    secrets = {d["metadata"]["name"]: d["stringData"] for d in yaml.safe_load_all((DEPLOY / "k8s" /
                                                                                    "secrets.example.yaml").read_text())}
    router_tokens = tomllib.loads(secrets["edgefire-router"]["tokens.toml"])
    assert "peer_token" not in router_tokens
    assert secrets["edgefire-agent"]["agent-token-sha256"] == token_digest(router_tokens["agent_token"])
    assert secrets["edgefire-agent"]["peer-token"] != router_tokens["agent_token"]


def test_generated_tokens_are_distinct_and_given_ones_must_be(tmp_path, tiny_model_dir):
    config = ClusterConfig(model_dir=tiny_model_dir, sites=two_sites(), state_dir=tmp_path)
    assert len({getattr(config, name) for name in TOKENS}) == len(TOKENS)
    for name in ("agent_token", "router_token", "admin_token"):
        with pytest.raises(ClusterConfigError, match=f"{name} and peer_token: must differ"):
            ClusterConfig(model_dir=tiny_model_dir, sites=two_sites(), state_dir=tmp_path,
                          **{name: "same-token", "peer_token": "same-token"})


@pytest.mark.parametrize("table, name", [("router", "agent_token"), ("router", "peer_token"),
                                         ("agent", "agent_token_sha256"), ("agent", "peer_token"),
                                         ("agent", "accept_peer_tokens")])
def test_a_cluster_file_cannot_set_the_tokens_the_launcher_writes(tmp_path, table, name):
    path = tmp_path / "cluster.toml"
    path.write_text(f'[{table}]\n{name} = "x"\n[[sites]]\nname = "a"\nregion = "r"\ncountry = "PT"\n'
                    f'lat = 1.0\nlon = 2.0\n')
    with pytest.raises(ClusterConfigError, match=re.escape(f"{table}.{name}: set by the launcher")):
        load_cluster_toml(path)
