"""One real cluster for the end-to-end tests: registry, three agents and a router, as processes on loopback.

The sites are the demo's mix: `lisbon` prefills only, `frankfurt` decodes only, `warsaw` does both.
Tests that change the cluster (cordons, kills, a stopped registry) put it back before they end, so
the order of the test files matters only for the drain test, which runs last.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from deploy.cluster_config import ClusterConfig, demo_sites
from deploy.launcher import Cluster
from node_agent.client import AgentClient
from tests.metrics_text import Samples

PREFILL_ONLY, DECODE_ONLY, BOTH = "lisbon", "frankfurt", "warsaw"
REGISTRY_RENDER_S = 1.0  # the registry re-renders its snapshot body at most this often (SnapshotCache)


@pytest.fixture(scope="session")
def endless_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny demo model with no end-of-text token: greedy runs always reach max_tokens, so a
    stream lasts as long as a test needs for a fault or a drain to land in its middle."""
    model_dir = tmp_path_factory.mktemp("endless") / "tiny"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": []}))
    return model_dir


def cluster_config(model_dir: Path, state_dir: Path, tls: bool = False) -> ClusterConfig:
    sites = demo_sites(3)
    for site in sites:
        site.grpc_port = site.metrics_port = 0
    return ClusterConfig(
        model_dir=model_dir, model_name="tiny", sites=sites, state_dir=state_dir, router_port=0, registry_port=0,
        tls=tls,
        agent={"heartbeat_interval_s": 1.0, "kv_cache_bytes": 8 << 20, "kv_lease_ttl_s": 5.0,
               "drain_timeout_s": 20.0, "device": "cpu", "dtype": "float32"},
        # A huge affinity slack lets a session key alone pick the first candidate: repeatable placement.
        # snapshot_max_age_s is short so the registry-outage test outlives it in seconds.
        router={"affinity_slack": 1000.0, "snapshot_refresh_s": 0.2, "first_token_timeout_s": 10.0,
                "token_idle_timeout_s": 10.0, "cooldown_s": 3.0, "snapshot_max_age_s": 2.0,
                "site_check_interval_s": 0.5, "placement_report_interval_s": 0.5})


# Package scope: the cluster stops once the last end-to-end test is done, not at the end of the session,
# so the rest of the suite on this worker does not run beside its five idle processes.
@pytest.fixture(scope="package")
def cluster(endless_model_dir, tmp_path_factory) -> Iterator[Cluster]:
    cluster = Cluster(cluster_config(endless_model_dir, tmp_path_factory.mktemp("cluster")))
    cluster.start(timeout_s=120)
    yield cluster
    cluster.stop()


@pytest.fixture
def http(cluster) -> Iterator[httpx.Client]:
    with router_client(cluster) as client:
        yield client


def router_client(cluster: Cluster, timeout_s: float = 60.0) -> httpx.Client:
    return cluster.http_client(base_url=cluster.router_url, timeout=timeout_s,
                               headers={"Authorization": f"Bearer {cluster.api_key}"})


@dataclass(slots=True)
class Completion:
    text: str
    finish_reason: str | None
    headers: dict
    usage: dict | None = None
    chunks: list[str] = field(default_factory=list)

    @property
    def sites(self) -> tuple[str, str]:
        return self.headers["x-edgefire-prefill-site"], self.headers["x-edgefire-decode-site"]


def completion_body(cluster: Cluster, prompt: list[int], max_tokens: int, **extra) -> dict:
    return {"model": cluster.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def complete(http: httpx.Client, cluster: Cluster, prompt: list[int], max_tokens: int,
             headers: dict | None = None) -> Completion:
    response = http.post("/v1/completions", json=completion_body(cluster, prompt, max_tokens), headers=headers)
    assert response.status_code == 200, response.text
    body = response.json()
    return Completion(body["choices"][0]["text"], body["choices"][0]["finish_reason"], dict(response.headers),
                      body["usage"])


def stream(http: httpx.Client, cluster: Cluster, prompt: list[int], max_tokens: int,
           on_first_chunk=None) -> Completion:
    """A streamed greedy completion; `on_first_chunk(headers)` runs once the first text arrives."""
    body = completion_body(cluster, prompt, max_tokens, stream=True, stream_options={"include_usage": True})
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        result = Completion("", None, dict(response.headers))
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            if event.get("usage"):
                result.usage = event["usage"]
            for choice in event["choices"]:
                if choice["text"] and not result.chunks and on_first_chunk is not None:
                    on_first_chunk(result.headers)
                result.chunks.append(choice["text"])
                result.text += choice["text"]
                result.finish_reason = choice["finish_reason"] or result.finish_reason
    return result


def prompt_ids(n: int = 40, start: int = 7) -> list[int]:
    return [(start + 13 * i) % 500 + 5 for i in range(n)]


@dataclass(slots=True)
class LongPrompt:
    prompt: list[int]
    reference: Completion   # its fault-free greedy completion of DRAIN_TOKENS tokens


@pytest.fixture(scope="package")
def long_prompt(cluster) -> LongPrompt:
    """A prompt and its fault-free greedy completion of DRAIN_TOKENS tokens (about a second or more)."""
    with router_client(cluster, timeout_s=120.0) as http:
        prompt = prompt_ids(40, start=171)
        return LongPrompt(prompt, complete(http, cluster, prompt, DRAIN_TOKENS))


LONG_TOKENS = 160
DRAIN_TOKENS = 1900  # the prompt's 40 and these fill most of the tiny model's 2,048 positions


def settle(cluster: Cluster) -> None:
    """Returns once the router holds a snapshot rendered after the call: one registry render, then a
    router refresh after it (a fixed sleep of both was too short on a loaded machine now and then)."""
    time.sleep(REGISTRY_RENDER_S)
    wait_for_router_snapshot(cluster, time.monotonic())


def router_health(cluster: Cluster) -> dict:
    with cluster.http_client(timeout=5.0) as client:
        return client.get(f"{cluster.router_url}/healthz").json()


def wait_for_router_snapshot(cluster: Cluster, since: float, timeout_s: float = 30.0) -> None:
    """Returns once the router has fetched its snapshot after `since` (time.monotonic())."""
    while time.monotonic() < since + timeout_s:
        asked_at = time.monotonic()
        age_s = router_health(cluster).get("snapshot_age_s")
        if age_s is not None and age_s < asked_at - since:
            return
        time.sleep(0.05)
    raise AssertionError(f"the router took in no snapshot within {timeout_s:.0f} s")


def agent_health(cluster: Cluster, site: str):
    async def ask():
        async with AgentClient(cluster.site_address(site), cluster.config.peer_token,
                               credentials=cluster.agent_credentials()) as agent:
            return await agent.health(timeout=5.0)
    return asyncio.run(ask())


def router_log(cluster: Cluster) -> str:
    return cluster.processes["router"].log_path.read_text(errors="replace")


def site_log(cluster: Cluster, site: str) -> str:
    return cluster.processes[site].log_path.read_text(errors="replace")


def router_metrics(cluster: Cluster) -> Samples:
    with cluster.http_client(timeout=10.0) as http:
        response = http.get(cluster.router_metrics_url)
    response.raise_for_status()
    return Samples.parse(response.text)
