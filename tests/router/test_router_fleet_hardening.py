"""Keys, limits and reports across routers, as an operator and a client meet them: a revoked key is
refused (401) by every router soon after the revocation, not after the key cache's TTL; a request that
could never fit its key's tokens-per-minute is a 400 saying what to change, not a 429 to retry; a
router that could not report for minutes still gets its usage accepted when the registry returns."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from router_fake_agent import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def _status_until(http: httpx.AsyncClient, url: str, headers: dict, wanted: int, timeout_s: float) -> int:
    """Sends the request until it answers `wanted` or `timeout_s` passes; the last status."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        status = (await http.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers)).status_code
        if status == wanted or loop.time() > deadline:
            return status
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("limits", [{}, {"requests_per_minute": 1000}], ids=["unlimited", "limited"])
async def test_a_revoked_key_gets_401_on_every_router_within_seconds(cluster, make_router, http, limits):
    await cluster.add_site("fra", 50.1, 8.7)
    created = await cluster.admin.create_api_key("leaked", **limits)
    headers = {"Authorization": f"Bearer {created['key']}"}
    # The key cache would honour the key for a minute: only the registry's word can end it sooner.
    urls = [(await make_router(name=f"router-{i}", api_key_cache_s=60.0, report_interval_s=0.2))[1] for i in (1, 2)]
    for url in urls:
        assert (await http.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers)).status_code == 200
    await cluster.admin.revoke_api_key(created["id"])
    for url in urls:
        assert await _status_until(http, url, headers, 401, timeout_s=5.0) == 401
        response = await http.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


async def test_a_request_over_the_whole_tokens_per_minute_is_a_400_saying_what_to_lower(cluster, make_router, http):
    await cluster.add_site("fra", 50.1, 8.7)
    key = await cluster.create_key(tokens_per_minute=100)
    _router, url = await make_router()
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as caught:   # a 429 would have the client wait and retry in vain
            await client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=500)
        assert caught.value.param == "max_tokens"
        assert "limit of 100 tokens per minute" in caught.value.message and "Lower max_tokens" in caught.value.message
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=MODEL, prompt="the cat sat " * 40, max_tokens=1)
        assert caught.value.param == "prompt" and "Shorten the prompt" in caught.value.message
        # The refusals took nothing from the key: a request that fits is served at once.
        reply = await client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=3)
        assert reply.usage.completion_tokens >= 1
