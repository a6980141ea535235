"""Faults through the real stack: sites killed with SIGKILL mid-request, and the registry stopped."""

from __future__ import annotations

import re
import time

from tests.e2e.conftest import LONG_TOKENS, complete, completion_body, prompt_ids, router_log, stream


def test_prefill_site_killed_request_served_elsewhere(cluster, http):
    """Runs first in this file, while no site is cooling down, so the session key places both requests alike."""
    prompt, session = prompt_ids(50, start=3), {"x-session-affinity": "prefill-kill"}
    reference = complete(http, cluster, prompt, 16, session)
    prefill_site = reference.sites[0]
    cluster.kill_site(prefill_site)  # the registry still lists it alive for a few seconds
    try:
        after = complete(http, cluster, prompt, 16, session)
        streamed = stream(http, cluster, prompt, 16)
    finally:
        cluster.start_site(prefill_site)
    assert prefill_site not in after.sites and prefill_site not in streamed.sites
    assert after.text == streamed.text == reference.text
    assert int(after.headers["x-edgefire-attempts"]) >= 2  # the dead site was tried, then passed over


def test_decode_site_killed_mid_stream_resumes_elsewhere(cluster, http, long_prompt):
    reference = stream(http, cluster, long_prompt.prompt, LONG_TOKENS)
    killed: list[str] = []

    def kill_decode_site(headers) -> None:
        killed.append(headers["x-edgefire-decode-site"])
        cluster.kill_site(killed[0])

    try:
        faulty = stream(http, cluster, long_prompt.prompt, LONG_TOKENS, on_first_chunk=kill_decode_site)
    finally:
        for site in killed:
            cluster.start_site(site)
    assert faulty.text == reference.text
    assert faulty.finish_reason == reference.finish_reason == "length"
    assert faulty.usage["completion_tokens"] == reference.usage["completion_tokens"] == LONG_TOKENS
    # The kill really landed mid-stream: the router resumed after some tokens had been sent.
    request_id = faulty.headers["x-request-id"]
    failure = re.search(rf"request {request_id}: site {killed[0]} failed \(\w+\) after (\d+) token", router_log(cluster))
    assert failure is not None and 0 < int(failure.group(1)) < LONG_TOKENS


def test_registry_outage_serves_from_last_snapshot_then_heartbeats_resume(cluster, http):
    complete(http, cluster, prompt_ids(20), 4)  # the router has a snapshot and knows the key
    cluster.stop_registry()
    stopped_at = time.time()
    try:
        during = [complete(http, cluster, prompt_ids(20, start=i), 4) for i in range(3)]
        time.sleep(3.5)  # past the registry's liveness window: heartbeats are failing now
        during.append(stream(http, cluster, prompt_ids(30), 8))
    finally:
        cluster.start_registry()
    assert all(c.finish_reason in ("stop", "length") and c.text for c in during)

    def every_site_heartbeated_since_restart() -> bool:
        sites = cluster.snapshot()["sites"]
        return all(s["alive"] and s["capacity"]["reported_at"] > stopped_at + 3.5 for s in sites)

    cluster.wait_for(every_site_heartbeated_since_restart, 20.0, "heartbeats to resume")

    # A freshly restarted registry first reports every site as dead (their heartbeats were backing
    # off while it was down), and the router follows that view until it refreshes: the router
    # answers 503 + Retry-After for that moment. Requests must be served again once it has caught up.
    def router_serves_again() -> bool:
        response = http.post("/v1/completions", json=completion_body(cluster, prompt_ids(20, start=9), 4))
        assert response.status_code in (200, 503), response.text
        return response.status_code == 200 and bool(response.json()["choices"][0]["text"])

    cluster.wait_for(router_serves_again, 10.0, "the router to serve from the registry's new snapshot")
