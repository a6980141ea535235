"""Operations through the real stack: no KV blocks leak over the whole run, and a drained site
finishes what it has in flight, then takes nothing new and exits. Runs last: the drain is final."""

from __future__ import annotations

import time

from tests.e2e.conftest import DRAIN_TOKENS, agent_health, complete, prompt_ids, router_log, settle, stream


def test_every_agents_kv_blocks_are_free_after_the_run(cluster):
    for site in cluster.config.sites:
        deadline = time.monotonic() + 15.0  # unfetched leases expire after kv_lease_ttl_s
        while True:
            health = agent_health(cluster, site.name)
            idle = (health.kv_blocks_free == health.kv_blocks_total and health.num_kv_leases == 0
                    and health.num_running == 0)
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert health.kv_blocks_total > 0
        assert (site.name, health.kv_blocks_free, health.num_kv_leases) == (site.name, health.kv_blocks_total, 0)


def test_drained_site_finishes_in_flight_then_takes_none(cluster, http, long_prompt):
    drained: list[str] = []

    def drain_decode_site(headers) -> None:
        drained.append(headers["x-edgefire-decode-site"])
        cluster.admin().drain(drained[0], deadline_s=60)

    during = stream(http, cluster, long_prompt.prompt, DRAIN_TOKENS, on_first_chunk=drain_decode_site)
    site = drained[0]
    assert during.text == long_prompt.reference.text
    assert during.finish_reason == "length"
    assert f"request {during.headers['x-request-id']}: site" not in router_log(cluster)  # no failover: it finished there
    # Drained: the agent learned of it (with its next heartbeat, which on a fast machine may come after the
    # stream's last token), deregistered and exited by itself, cleanly.
    assert cluster.processes[site].popen.wait(30) == 0
    assert "the registry asks this site to drain" in cluster.processes[site].log_path.read_text()
    assert cluster.site_state(site)["state"] == "draining"
    settle(cluster)
    served = [complete(http, cluster, prompt_ids(20, start=i), 4).sites for i in range(4)]
    assert all(site not in pair for pair in served)
