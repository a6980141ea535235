"""End-to-end basics: a chat completion through a real registry and a fake agent, streamed and not."""

from __future__ import annotations

import asyncio
import json

from router_fake_agent import MODEL


async def test_chat_completion_names_sites_and_counts_usage(cluster, make_router, http):
    agent = await cluster.add_site("fra", 50.1, 8.7)
    key = await cluster.create_key()
    _router, url = await make_router()
    response = await http.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                               json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert response.headers["x-edgefire-prefill-site"] == "fra"
    assert response.headers["x-edgefire-decode-site"] == "fra"
    assert response.headers["x-edgefire-attempts"] == "1"
    assert agent.metadata[-1]["authorization"].startswith("Bearer ")
    assert agent.metadata[-1]["x-request-id"] == response.headers["x-request-id"]


async def test_stream_has_role_text_finish_usage_and_done(cluster, make_router, http):
    await cluster.add_site("fra", 50.1, 8.7)
    key = await cluster.create_key()
    _router, url = await make_router()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.stream("POST", f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                           json=body) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


async def test_client_disconnect_cancels_the_agent_stream(cluster, make_router, http):
    agent = await cluster.add_site("fra", 50.1, 8.7)
    agent.token_delay_s = 0.05
    key = await cluster.create_key()
    _router, url = await make_router()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}
    async with http.stream("POST", f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                           json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break  # one token seen; hang up
    for _ in range(100):
        if agent.num_cancelled:
            break
        await asyncio.sleep(0.02)
    assert agent.num_cancelled == 1


async def test_session_affinity_header_keeps_a_session_on_one_site(cluster, make_router, http):
    for name in ("a", "b", "c"):
        await cluster.add_site(name, 50.1, 8.7)
    key = await cluster.create_key()
    _router, url = await make_router()
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    seen = {}
    for session in ("s1", "s2", "s3", "s4", "s5", "s6"):
        sites = set()
        for _ in range(3):
            response = await http.post(f"{url}/v1/completions", json=body,
                                       headers={"Authorization": f"Bearer {key}", "x-session-affinity": session})
            sites.add(response.headers["x-edgefire-decode-site"])
        assert len(sites) == 1
        seen[session] = sites.pop()
    assert len(set(seen.values())) > 1


async def test_openai_user_field_keys_the_session_when_the_header_is_absent(cluster, make_router, http):
    for name in ("a", "b", "c"):
        await cluster.add_site(name, 50.1, 8.7)
    key = await cluster.create_key()
    _router, url = await make_router()
    seen = {}
    for user in ("u1", "u2", "u3", "u4", "u5", "u6"):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1, "user": user}
        sites = set()
        for _ in range(3):
            response = await http.post(f"{url}/v1/chat/completions", json=body,
                                       headers={"Authorization": f"Bearer {key}"})
            sites.add(response.headers["x-edgefire-decode-site"])
        assert len(sites) == 1
        seen[user] = sites.pop()
    assert len(set(seen.values())) > 1
