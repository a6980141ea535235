"""The router's /metrics after real traffic: counters and histograms move by exactly what the
requests did, on the metrics port and never on the public one."""

from __future__ import annotations

import grpc
import httpx
import pytest
from router_fake_agent import MODEL

from router.metrics import RouterMetrics
from router.placement_report import PlacementReporter
from tests.metrics_text import Samples

FRA, LON, PAR = (50.1, 8.7), (51.5, -0.12), (48.86, 2.35)


def chat(max_tokens: int = 6, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "how are the edge sites"}],
            "max_tokens": max_tokens, "temperature": 0, **extra}


async def scrape(http, router) -> Samples:
    response = await http.get(f"http://127.0.0.1:{router.metrics_port}/metrics")
    assert response.status_code == 200
    return Samples.parse(response.text)


@pytest.fixture
async def split_pair(cluster, make_router):
    """fra prefills only, lon decodes only: every request is split between them."""
    await cluster.add_site("fra", *FRA, role="prefill")
    await cluster.add_site("lon", *LON, role="decode")
    key = await cluster.create_key()
    router, url = await make_router(metrics_listen="127.0.0.1:0")
    return router, url, {"Authorization": f"Bearer {key}"}


async def test_one_split_stream_moves_each_counter_by_what_it_did(split_pair, cluster, http):
    router, url, auth = split_pair
    cluster.agents["fra"].num_cached_tokens = 16  # the prefill site's prefix cache held one block
    before = await scrape(http, router)
    async with http.stream("POST", f"{url}/v1/chat/completions", headers=auth,
                           json=chat(6, stream=True, stream_options={"include_usage": True})) as response:
        lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
    assert response.status_code == 200
    usage = [line for line in lines if '"usage":{' in line][-1]
    after = await scrape(http, router)

    split = {"kind": "split", "prefill_site": "fra", "decode_site": "lon", "region": "eu"}
    assert after.delta(before, "edgefire_router_placements_total", **split) == 1
    assert after.delta(before, "edgefire_router_placements_total", kind="colocated") == 0
    assert after.delta(before, "edgefire_router_requests_total", model=MODEL, route="chat", status="200") == 1
    assert after.delta(before, "edgefire_router_time_to_first_token_seconds_count", model=MODEL) == 1
    assert after.delta(before, "edgefire_router_e2e_request_latency_seconds_count", model=MODEL) == 1
    # The first token comes from the prefill site, the other five from the decode site one chunk each.
    assert after.delta(before, "edgefire_router_inter_token_latency_seconds_count", model=MODEL) == 5
    assert after.delta(before, "edgefire_router_generation_tokens_total", model=MODEL) == 6
    assert '"completion_tokens":6' in usage
    prompt_tokens = int(usage.split('"prompt_tokens":')[1].split(",")[0])
    assert after.delta(before, "edgefire_router_prompt_tokens_total", model=MODEL) == prompt_tokens
    assert after.delta(before, "edgefire_router_cached_prompt_tokens_total", model=MODEL) == 16
    assert after.delta(before, "edgefire_router_failovers_total") == 0
    assert after.get("edgefire_router_requests_running") == 0
    assert after.get("edgefire_router_live_sites") == 2
    assert 0 <= after.get("edgefire_router_snapshot_age_seconds") < 60


async def test_n_choices_count_the_prompt_once_as_usage_does(split_pair, http):
    router, url, auth = split_pair
    before = await scrape(http, router)
    response = await http.post(f"{url}/v1/chat/completions", headers=auth, json=chat(4, n=3, temperature=1.0, seed=3))
    assert response.status_code == 200, response.text
    body = response.json()
    after = await scrape(http, router)
    assert len(body["choices"]) == 3
    assert after.delta(before, "edgefire_router_prompt_tokens_total", model=MODEL) == body["usage"]["prompt_tokens"]
    assert after.delta(before, "edgefire_router_generation_tokens_total", model=MODEL) == \
        body["usage"]["completion_tokens"] == 12
    assert after.delta(before, "edgefire_router_requests_total", model=MODEL, route="chat", status="200") == 1


async def test_the_public_port_does_not_serve_metrics(split_pair, http):
    _router, url, auth = split_pair
    assert (await http.get(f"{url}/metrics", headers=auth)).status_code == 404


async def test_refusals_unknown_models_and_rate_limits_are_counted_with_bounded_labels(cluster, make_router, http):
    near = await cluster.add_site("fra", *FRA)
    await cluster.add_site("par", *PAR)
    key = await cluster.create_key(requests_per_minute=2)
    router, url = await make_router(metrics_listen="127.0.0.1:0")
    auth = {"Authorization": f"Bearer {key}"}
    before = await scrape(http, router)

    near.refuse = grpc.StatusCode.UNAVAILABLE
    assert (await http.post(f"{url}/v1/chat/completions", headers=auth, json=chat())).status_code == 200
    near.refuse = None
    for name in ("made-up-1", "made-up-2"):
        assert (await http.post(f"{url}/v1/chat/completions", headers=auth, json=chat(model=name))).status_code == 404
    statuses = [(await http.post(f"{url}/v1/completions", headers=auth,
                                 json={"model": MODEL, "prompt": "hi", "max_tokens": 2})).status_code
                for _ in range(2)]
    assert statuses == [200, 429]  # 2 a minute: the chat and one completion (404s never reach the limiter)
    after = await scrape(http, router)

    assert after.delta(before, "edgefire_router_failovers_total", reason="unavailable") == 1
    assert after.delta(before, "edgefire_router_site_failures_total", site="fra", reason="unavailable") == 1
    assert after.delta(before, "edgefire_router_placements_total", kind="colocated", decode_site="par") == 1
    assert after.delta(before, "edgefire_router_requests_total", model="unknown", route="chat", status="404") == 2
    assert not [s for s in after.series("edgefire_router_requests_total") if s["model"].startswith("made-up")]
    assert after.delta(before, "edgefire_router_rate_limited_requests_total", limit="requests") == 1
    assert after.delta(before, "edgefire_router_requests_total", model=MODEL, route="completions", status="429") == 1


async def test_a_stream_resumed_on_another_site_counts_one_resume(cluster, make_router, http):
    near = await cluster.add_site("fra", *FRA)
    await cluster.add_site("par", *PAR)
    key = await cluster.create_key()
    router, url = await make_router(metrics_listen="127.0.0.1:0")
    near.die_after = 3
    before = await scrape(http, router)
    async with http.stream("POST", f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                           json=chat(8, stream=True)) as response:
        body = "".join([line async for line in response.aiter_lines()])
    assert response.status_code == 200 and "[DONE]" in body
    after = await scrape(http, router)
    assert after.delta(before, "edgefire_router_resumes_total", reason="unavailable") == 1
    assert after.delta(before, "edgefire_router_failovers_total") == 0
    assert after.delta(before, "edgefire_router_generation_tokens_total", model=MODEL) == 8
    assert after.delta(before, "edgefire_router_time_to_first_token_seconds_count", model=MODEL) == 1


async def test_placed_pairs_reach_the_registry_for_the_dashboard(split_pair, cluster, http):
    router, url, auth = split_pair
    for _ in range(2):
        response = await http.post(f"{url}/v1/chat/completions", headers=auth, json=chat(2))
        assert response.status_code == 200
    await router.placement_reporter.report_now()
    placed = (await cluster.admin.placements(300))["pairs"]
    assert [(p["prefill_site"], p["decode_site"], p["num_requests"]) for p in placed] == [("fra", "lon", 2)]
    await router.placement_reporter.report_now()  # nothing new: nothing is counted twice
    assert (await cluster.admin.placements(300))["pairs"][0]["num_requests"] == 2


async def test_a_report_the_registry_refuses_is_kept_for_the_next_one():
    metrics, sent, failing = RouterMetrics(), [], [True]

    async def report(body):
        if failing[0]:
            raise httpx.ConnectError("registry down")
        sent.append(body)

    reporter = PlacementReporter(report, metrics, interval_s=60)
    metrics.placed("lis", "fra", "eu-west")
    await reporter.report_now()
    metrics.placed("lis", "fra", "eu-west")
    assert metrics.unreported == {("lis", "fra"): 2}
    assert metrics.registry_errors.labels("placements")._value.get() == 1
    failing[0] = False
    await reporter.report_now()
    assert sent == [[{"prefill_site": "lis", "decode_site": "fra", "num_requests": 2}]] and metrics.unreported == {}


async def test_responses_requests_are_counted_under_their_own_route(cluster, make_router, http):
    await cluster.add_site("fra", *FRA)
    key = await cluster.create_key()
    router, url = await make_router(metrics_listen="127.0.0.1:0")
    before = await scrape(http, router)
    response = await http.post(f"{url}/v1/responses", headers={"Authorization": f"Bearer {key}"},
                               json={"model": MODEL, "input": "how are the edge sites", "max_output_tokens": 4})
    assert response.status_code == 200, response.text
    after = await scrape(http, router)
    assert after.delta(before, "edgefire_router_requests_total", model=MODEL, route="responses", status="200") == 1
    assert after.delta(before, "edgefire_router_requests_total", model=MODEL, route="chat", status="200") == 0
