"""`edgefire up` with the pool planner on: a prefill-heavy burst moves the site allowed both roles
into the prefill pool, routers place by it, it comes back once the burst is over, and no request
fails on the way. The same cluster's agents measure the link between them (`edgefire status --links`)."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from deploy.cluster import config_from_args
from deploy.cli import build_parser
from deploy.cli import main as edgefire
from deploy.cluster_config import ClusterConfig, ClusterConfigError, SiteSpec
from deploy.launcher import Cluster
from tests.e2e.conftest import wait_for_router_snapshot

FLEX, DECODE_ONLY = "warsaw", "frankfurt"
# A planner tuned for a test: any queued prefill is "heavy", decode never is, short settle; the dwell
# outlasts the requests checked while warsaw is in the prefill pool, even on a loaded machine.
PLANNER = {"interval_s": 0.2, "min_dwell_s": 5.0, "settle_s": 0.5, "target_prefill_backlog_s": 0.001,
           "target_inter_token_s": 1000.0, "target_kv_used": 1.0}


def test_up_takes_a_planner_flag(tmp_path):
    args = build_parser().parse_args(["up", "--planner", "--state-dir", str(tmp_path)])
    assert config_from_args(args).planner is True
    args = build_parser().parse_args(["up", "--state-dir", str(tmp_path)])
    assert config_from_args(args).planner is False


def role_changes(cluster: Cluster) -> list[tuple[str, str, str]]:
    entries = cluster.admin().audit_log(limit=100)["items"]
    return [(e["target"], e["detail"]["from"], e["detail"]["to"]) for e in reversed(entries)
            if e["action"] == "site.active_role"]


async def burst(http: httpx.AsyncClient, model: str, num_requests: int, start: int) -> list[httpx.Response]:
    async def one(i: int) -> httpx.Response:
        prompt = [(start + i + 13 * j) % 500 + 5 for j in range(300)]
        return await http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4,
                                                        "temperature": 0})
    return await asyncio.gather(*(one(i) for i in range(num_requests)))


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


async def test_a_prefill_heavy_burst_moves_the_flexible_site_and_no_request_fails(tiny_model_dir, tmp_path, capsys):
    sites = [SiteSpec(DECODE_ONLY, "eu", "DE", 50.11, 8.68, "decode"), SiteSpec(FLEX, "eu", "PL", 52.23, 21.01, "both")]
    config = ClusterConfig(
        model_dir=tiny_model_dir, model_name="tiny", sites=sites, state_dir=tmp_path / "cluster", router_port=0,
        registry_port=0, planner=True, planner_settings=PLANNER,
        agent={"heartbeat_interval_s": 0.2, "kv_cache_bytes": 16 << 20, "device": "cpu", "dtype": "float32",
               "link_report_interval_s": 0.5},
        router={"snapshot_refresh_s": 0.2})
    cluster = Cluster(config)
    cluster.start(timeout_s=120)
    try:
        async with httpx.AsyncClient(base_url=cluster.router_url, timeout=60.0,
                                     headers={"Authorization": f"Bearer {cluster.api_key}"}) as http:
            responses = []
            deadline = time.monotonic() + 60
            while (FLEX, "both", "prefill") not in role_changes(cluster):
                assert time.monotonic() < deadline, "the burst never moved warsaw into the prefill pool"
                responses += await burst(http, cluster.model, 8, start=len(responses))
            # Routers follow the snapshot: new work now prefills at warsaw and decodes at frankfurt.
            wait_for(lambda: _active_role(cluster) == "prefill", 10, "the snapshot to show the change")
            await asyncio.to_thread(wait_for_router_snapshot, cluster, time.monotonic())
            after = await burst(http, cluster.model, 4, start=10_000)
            responses += after
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
        assert all(r.json()["usage"]["completion_tokens"] >= 1 for r in responses)
        assert all((r.headers["x-edgefire-prefill-site"], r.headers["x-edgefire-decode-site"]) == (FLEX, DECODE_ONLY)
                   for r in after)
        # The burst is over: once the dwell has passed, warsaw does both roles again.
        wait_for(lambda: (FLEX, "prefill", "both") in role_changes(cluster), 30, "warsaw to return to both roles")
        entry = next(e for e in cluster.admin().audit_log(limit=100)["items"] if e["action"] == "site.active_role")
        assert entry["actor"] == "planner" and entry["detail"]["reason"]

        # The agents measured the path between them (probes at start, then the split's KV pulls).
        wait_for(lambda: len(cluster.snapshot()["links"]) == 2, 10, "both sites to report their link")
        assert edgefire(["status", "--links", "--state-dir", str(config.state_dir)]) == 0
        matrix = capsys.readouterr().out.splitlines()
        assert matrix[0].split() == ["to", "\\", "from", DECODE_ONLY, FLEX]
        assert "Mbps" in matrix[2] or "Gbps" in matrix[2]
    finally:
        for process in cluster.processes.values():
            process.kill()  # a clean stop is not under test here, and draining costs seconds
        cluster.stop()


def _active_role(cluster: Cluster) -> str | None:
    return cluster.site_state(FLEX)["active_role"]


def test_up_refuses_planner_settings_that_make_no_sense_before_starting_anything(tmp_path):
    """A cluster file's [planner_settings] is checked as the registry would check it: refused by
    `edgefire up` itself, naming the table, rather than by a registry that then fails to start."""
    sites = [SiteSpec(DECODE_ONLY, "eu", "DE", 50.11, 8.68, "decode"), SiteSpec(FLEX, "eu", "PL", 52.23, 21.01, "both")]
    for settings, message in (({"low": 2.0, "high": 1.0}, "planner_settings: low (2.0) must be below high (1.0)"),
                              ({"min_dwell_s": 0.0}, "planner_settings: min_dwell_s: must be > 0")):
        with pytest.raises(ClusterConfigError, match=re.escape(message)):
            ClusterConfig(model_dir=tmp_path, sites=sites, state_dir=tmp_path / "cluster", planner=True,
                          planner_settings=settings)
    assert not (tmp_path / "cluster").exists()
