"""`edgefire up` runs its cluster split by role: routers present the agent token, agents present the
peer token to each other, the two are distinct, and agents hold the agent token's digest, not the token
(node_agent.auth). A split request (prefill site + decode site) is served end to end on it, and the peer
token a site holds opens none of the router's methods on another site."""

from __future__ import annotations

import asyncio
import re
import tomllib
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from grpc import aio

from deploy.cluster_config import ClusterConfig, ClusterConfigError, SiteSpec, load_cluster_toml
from deploy.launcher import Cluster
from node_agent.auth import token_digest
from node_agent.client import AgentClient

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


async def call_drain(address: str, token: str) -> grpc.StatusCode:
    async with AgentClient(address, token) as agent:
        try:
            await agent.drain(deadline_s=1.0, timeout=5)
        except aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def test_up_runs_split_and_serves_a_split_request(tmp_path, tiny_model_dir):
    config = ClusterConfig(
        model_dir=tiny_model_dir, model_name="tiny", sites=two_sites(), state_dir=tmp_path / "cluster",
        router_port=0, registry_port=0,
        agent={"heartbeat_interval_s": 0.5, "kv_cache_bytes": 8 << 20, "device": "cpu", "dtype": "float32"},
        router={"snapshot_refresh_s": 0.2})
    cluster = Cluster(config)
    cluster.start(timeout_s=120)
    try:
        written = {path.stem: path.read_text() for path in (config.state_dir / "config").glob("*.toml")}
        router = tomllib.loads(written["router"])["router"]
        assert router["agent_token"] == config.agent_token and "peer_token" not in router
        for site in (PREFILL_ONLY, DECODE_ONLY):
            agent = tomllib.loads(written[site])
            assert agent["peer_token"] == config.peer_token
            assert agent["agent_token_sha256"] == token_digest(config.agent_token)
            assert config.agent_token not in written[site]  # a site's files do not hold the routers' token

        response = httpx.post(f"{cluster.router_url}/v1/completions", timeout=60,
                              headers={"Authorization": f"Bearer {cluster.api_key}"},
                              json={"model": cluster.model, "prompt": "hello from the edge", "max_tokens": 8,
                                    "temperature": 0})
        assert response.status_code == 200, response.text
        assert (response.headers["x-edgefire-prefill-site"], response.headers["x-edgefire-decode-site"]) == \
            (PREFILL_ONLY, DECODE_ONLY)
        assert response.json()["usage"]["completion_tokens"] == 8
        decode_log = cluster.processes[DECODE_ONLY].log_path.read_text(errors="replace")
        assert "recomputing" not in decode_log  # the KV came over with the peer token
        assert "agent_token_sha256 is not set" not in decode_log

        # What the prefill site holds opens nothing of a router's on the decode site.
        address = cluster.site_address(DECODE_ONLY)
        assert asyncio.run(call_drain(address, config.peer_token)) == grpc.StatusCode.PERMISSION_DENIED
        with httpx.Client(base_url=cluster.router_url, timeout=60,
                          headers={"Authorization": f"Bearer {cluster.api_key}"}) as http:
            again = http.post("/v1/completions", json={"model": cluster.model, "prompt": "still here",
                                                       "max_tokens": 2})
        assert again.status_code == 200, again.text
    finally:
        cluster.stop()
