"""Split placement through the real stack: a prefill site and a different decode site serve one
request (KV moved between two processes), with the same tokens as a colocated run; the cluster runs
split by role, so the KV moves with the peer token, which opens none of the router's methods."""

from __future__ import annotations

import asyncio
import tomllib

import grpc
from grpc import aio

from deploy.launcher import Cluster
from node_agent.auth import token_digest
from node_agent.client import AgentClient
from tests.e2e.conftest import BOTH, DECODE_ONLY, PREFILL_ONLY, complete, prompt_ids, settle, site_log, stream
from tests.metrics_text import Samples


def only(cluster, *active: str) -> None:
    """Cordons every site but `active`, so placement has exactly one pair to choose."""
    admin = cluster.admin()
    for site in cluster.config.sites:
        (admin.uncordon if site.name in active else admin.cordon)(site.name)
    settle(cluster)


def uncordon_all(cluster) -> None:
    only(cluster, *(s.name for s in cluster.config.sites))


def test_split_run_equals_colocated_run(cluster, http):
    prompt = prompt_ids(70, start=11)  # several KV blocks to move
    try:
        only(cluster, PREFILL_ONLY, DECODE_ONLY)
        split = complete(http, cluster, prompt, 24)
        split_streamed = stream(http, cluster, prompt_ids(70, start=12), 24)
        only(cluster, BOTH)
        colocated = complete(http, cluster, prompt, 24)
        colocated_streamed = stream(http, cluster, prompt_ids(70, start=12), 24)
    finally:
        uncordon_all(cluster)
    assert split.sites == (PREFILL_ONLY, DECODE_ONLY) == split_streamed.sites
    assert colocated.sites == (BOTH, BOTH) == colocated_streamed.sites
    assert split.text == colocated.text
    assert split.usage["completion_tokens"] == colocated.usage["completion_tokens"]
    assert split_streamed.text == colocated_streamed.text
    assert split_streamed.usage == colocated_streamed.usage


def test_cordoned_site_gets_no_new_requests(cluster, http):
    try:
        cluster.admin().cordon(BOTH)
        settle(cluster)
        served = [complete(http, cluster, prompt_ids(20, start=i), 4).sites for i in range(6)]
    finally:
        uncordon_all(cluster)
    assert all(BOTH not in pair for pair in served)
    assert set(served) == {(PREFILL_ONLY, DECODE_ONLY)}
    assert cluster.site_alive(BOTH)  # cordoned is not down: it kept heartbeating


def site_metrics(cluster: Cluster, site: str) -> Samples:
    with cluster.http_client(timeout=10.0) as http:
        response = http.get(cluster.metrics_url(site))
    response.raise_for_status()
    return Samples.parse(response.text)


async def call_drain(address: str, token: str) -> grpc.StatusCode:
    async with AgentClient(address, token) as agent:
        try:
            await agent.drain(deadline_s=1.0, timeout=5)
        except aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def test_up_runs_split_tokens_and_the_peer_token_moves_the_kv_and_opens_no_router_method(cluster, http):
    """`edgefire up` runs its cluster split by role: routers present the agent token, agents present the
    peer token to each other, and agents hold the agent token's digest, not the token (node_agent.auth)."""
    config = cluster.config
    written = {path.stem: path.read_text() for path in (cluster.state_dir / "config").glob("*.toml")}
    router = tomllib.loads(written["router"])["router"]
    assert router["agent_token"] == config.agent_token and "peer_token" not in router
    for site in config.sites:
        agent = tomllib.loads(written[site.name])
        assert agent["peer_token"] == config.peer_token
        assert agent["agent_token_sha256"] == token_digest(config.agent_token)
        assert config.agent_token not in written[site.name]  # a site's files do not hold the routers' token
    assert "agent_token_sha256 is not set" not in site_log(cluster, DECODE_ONLY)

    before = site_metrics(cluster, DECODE_ONLY)
    try:
        only(cluster, PREFILL_ONLY, DECODE_ONLY)
        split = complete(http, cluster, prompt_ids(40, start=23), 8)
        # What the prefill site holds opens nothing of a router's on the decode site: no drain there.
        refused = asyncio.run(call_drain(cluster.site_address(DECODE_ONLY), config.peer_token))
        again = complete(http, cluster, prompt_ids(20, start=29), 2)
    finally:
        uncordon_all(cluster)
    assert split.sites == (PREFILL_ONLY, DECODE_ONLY) == again.sites
    assert split.usage["completion_tokens"] == 8
    after = site_metrics(cluster, DECODE_ONLY)
    # The KV came over with the peer token: bytes pulled, none recomputed.
    assert after.delta(before, "edgefire_agent_kv_bytes_received_total") > 0
    assert after.delta(before, "edgefire_agent_kv_transfer_fallbacks_total") == 0
    assert refused == grpc.StatusCode.PERMISSION_DENIED
