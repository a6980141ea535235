"""`edgefire registry serve --workers 2`: two processes on one port agree on what they store.

Each worker has its own heartbeat group commit and snapshot cache; a router must see every
heartbeat whichever worker stored it and whichever worker answers the snapshot, and a scrape of
/metrics counts every worker's work.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.metrics_text import Samples

from .conftest import ADMIN_TOKEN, ROUTER_TOKEN

ROOT = Path(__file__).resolve().parents[2]
NUM_SITES = 6


def start_workers(db_url: str, port: int) -> subprocess.Popen:
    argv = ["registry", "serve", "--db", db_url, "--port", str(port), "--workers", "2", "--admin-token", ADMIN_TOKEN,
            "--router-token", ROUTER_TOKEN, "--no-migrate"]
    code = ("import argparse, sys; from registry import cli; parser = argparse.ArgumentParser(); "
            f"cli.add_parser(parser.add_subparsers()); args = parser.parse_args({argv!r}); sys.exit(args.func(args))")
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).raise_for_status()
            return process
        except httpx.HTTPError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError("registry serve --workers 2 did not start")
            time.sleep(0.2)


def test_two_workers_share_heartbeats_and_snapshots(db_url):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    process = start_workers(db_url, port)
    try:
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        many_headers = {f"x-h{i}": "v" for i in range(200)}  # the served head limits (registry.http_head)
        assert httpx.get(f"{base}/healthz", headers=many_headers).status_code == 431
        tokens = []
        for i in range(NUM_SITES):
            httpx.post(f"{base}/v1/admin/sites", headers=admin, json={"name": f"site-{i}"}).raise_for_status()
            tokens.append(httpx.post(f"{base}/v1/admin/sites/site-{i}/tokens", headers=admin, json={}).json()["token"])
        router = {"Authorization": f"Bearer {ROUTER_TOKEN}"}
        for round_ in range(3):
            for i, token in enumerate(tokens):  # a new connection per request: both workers take some
                reply = httpx.post(f"{base}/v1/agent/heartbeat", headers={"Authorization": f"Bearer {token}"},
                                   json={"kv_blocks_total": 100, "kv_blocks_free": 10 * round_ + i, "block_size": 16})
                assert reply.json() == {"state": "active", "drain_deadline": None, "active_role": None}
            for _ in range(4):
                sites = httpx.get(f"{base}/v1/router/snapshot", headers=router).json()["sites"]
                assert [s["capacity"]["kv_blocks_free"] for s in sites] == [10 * round_ + i for i in range(NUM_SITES)]
                assert all(s["alive"] for s in sites)
        # Whichever worker answers a scrape, it sums both workers' counters.
        for _ in range(4):
            samples = Samples.parse(httpx.get(f"{base}/metrics", headers=admin).text)
            assert samples.get("edgefire_registry_heartbeats_total", outcome="stored") == 3 * NUM_SITES
            assert samples.get("edgefire_registry_admin_actions_total", action="create_site") == NUM_SITES
            assert samples.get("edgefire_registry_sites", state="active") == NUM_SITES  # alive or not: no timing
    finally:
        process.terminate()
        process.wait(30)
