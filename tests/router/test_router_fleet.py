"""Several routers act as one: a key's rate limit holds across them, and what each serves is accounted
once in the registry, equal to what clients saw in `usage`."""

from __future__ import annotations

import asyncio
import json

import pytest
from router_fake_agent import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture
async def two_routers(cluster, make_router):
    await cluster.add_site("fra", 50.1, 8.7)
    routers = [await make_router(name=f"router-{i}") for i in (1, 2)]
    return [router for router, _url in routers], [url for _router, url in routers]


async def test_a_keys_limit_holds_across_routers(cluster, two_routers, http):
    _routers, urls = two_routers
    key = await cluster.create_key(requests_per_minute=5)
    headers = {"Authorization": f"Bearer {key}"}
    statuses = []
    for i in range(12):   # alternating between the routers: each alone would admit 5
        response = await http.post(f"{urls[i % 2]}/v1/chat/completions", json=CHAT, headers=headers)
        statuses.append(response.status_code)
        if response.status_code == 429:
            assert response.json()["error"]["code"] == "rate_limit_exceeded"
            assert int(response.headers["retry-after"]) >= 1
    assert statuses.count(200) == 5 and statuses.count(429) == 7
    health = (await http.get(f"{urls[0]}/healthz")).json()["rate_limits"]
    assert (health["mode"], health["reports_failing"]) == ("global", False)
    for _ in range(100):   # the registry counts both routers from its next answer on (a report a second)
        if (await http.get(f"{urls[0]}/healthz")).json()["rate_limits"]["live_routers"] == 2:
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("router-1 never learned that two routers share the limit")


async def test_usage_in_the_registry_equals_what_clients_saw(cluster, two_routers, http):
    routers, urls = two_routers
    key = await cluster.create_key()
    headers = {"Authorization": f"Bearer {key}"}
    seen = {"requests": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0, "completion_tokens": 0}

    def count(usage: dict) -> None:
        seen["requests"] += 1
        seen["prompt_tokens"] += usage["prompt_tokens"]
        seen["cached_prompt_tokens"] += usage["prompt_tokens_details"]["cached_tokens"]
        seen["completion_tokens"] += usage["completion_tokens"]

    for i in range(6):
        body = {**CHAT, "max_tokens": 2 + i, "messages": [{"role": "user", "content": "hello " * (i + 1)}]}
        if i % 3 == 2:   # a stream, its usage in the last chunk
            body.update(stream=True, stream_options={"include_usage": True})
            async with http.stream("POST", f"{urls[i % 2]}/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
            count(json.loads(lines[-1].removeprefix("data: "))["usage"])
        else:
            response = await http.post(f"{urls[i % 2]}/v1/chat/completions", json=body, headers=headers)
            assert response.status_code == 200
            count(response.json()["usage"])
    # Several prompts with n choices each: every prompt is metered once, as the client's usage counts it.
    body = {"model": MODEL, "prompt": ["hello", "hello there friend"], "n": 2, "max_tokens": 3}
    response = await http.post(f"{urls[0]}/v1/completions", json=body, headers=headers)
    assert response.status_code == 200 and len(response.json()["choices"]) == 4
    count(response.json()["usage"])
    for router in routers:   # a clean stop sends the last report
        await router.fleet.stop()
    rows = await cluster.admin.usage(granularity="total")
    assert [(row["key_id"], row["model"]) for row in rows["items"]] == [(rows["items"][0]["key_id"], MODEL)]
    assert {name: rows["totals"][name] for name in seen} == seen
    routers_seen = (await cluster.admin.routers())["items"]
    assert sorted(r["name"] for r in routers_seen) == ["router-1", "router-2"]
