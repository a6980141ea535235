"""Issue 17, defects 1 and 2 through the real stack: a site token holder sending poisoned
heartbeats (bad hashes, out-of-range integers, wrong types) in a loop changes nothing for clients.
The registry refuses each (422) before storing or batching it; routers keep serving; the real
sites' heartbeats keep landing."""

from __future__ import annotations

import time

import httpx

from tests.e2e.conftest import BOTH, DECODE_ONLY, PREFILL_ONLY, router_health
from tests.e2e.test_03_faults import Requester

GOOD = {"kv_blocks_total": 100, "kv_blocks_free": 50, "block_size": 16}
POISON = [{**GOOD, "prefix_cache_summary": {"block_size": 16, "hashes": ["zz"]}},
          {**GOOD, "kv_blocks_total": 2**63, "kv_blocks_free": 0},
          {**GOOD, "num_running": 2**40}, {**GOOD, "block_size": "16"}, {**GOOD, "draining": 1}]
POISON_S = 2.0


def test_a_site_sending_poisoned_heartbeats_changes_nothing_for_clients(cluster):
    admin = cluster.admin()
    admin.create_site("mallory", region="eu-west", country="DE", lat=50.0, lon=8.0)
    token = admin.issue_site_token("mallory")["token"]
    requester = Requester(cluster)
    requester.start()
    statuses = []
    try:
        with httpx.Client(base_url=cluster.registry_url, timeout=10.0,
                          headers={"Authorization": f"Bearer {token}"}) as mallory:
            deadline = time.monotonic() + POISON_S
            while time.monotonic() < deadline:
                for body in POISON:
                    statuses.append(mallory.post("/v1/agent/heartbeat", json=body).status_code)
        served_before = requester.num_served
        cluster.wait_for(lambda: requester.num_served > served_before + 2, 20.0, "requests after the poison")
    finally:
        requester.stop()
        admin.delete_site("mallory")
    assert set(statuses) == {422} and len(statuses) >= len(POISON)
    assert requester.failures == [], "\n".join(requester.failures)
    assert requester.num_served > 3
    assert router_health(cluster)["ok"]
    assert all(cluster.site_alive(name) for name in (PREFILL_ONLY, DECODE_ONLY, BOTH))
