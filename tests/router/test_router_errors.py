"""Every client error comes back as an OpenAI error body with the right status and headers."""

from __future__ import annotations

import openai
import pytest
from router_fake_agent import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def assert_openai_error(response, status, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.fixture
async def served(cluster, make_router):
    await cluster.add_site("fra", 50.1, 8.7)
    key = await cluster.create_key()
    _router, url = await make_router(max_body_bytes=4096, max_prompt_tokens=200)
    return url, {"Authorization": f"Bearer {key}"}


BAD_FIELDS = [
    ({"model": None}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),  # not an empty turn the client never meant
    ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "x"}]}, "messages[0].content"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"n": 17}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": 5000}, "max_tokens"),  # prompt + max_tokens beyond the 1024-token context
]


async def test_bad_fields_are_400_naming_the_field(served, http):
    url, headers = served
    for change, param in BAD_FIELDS:
        body = {k: v for k, v in {**CHAT, **change}.items() if v is not None}
        response = await http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        assert_openai_error(response, 400, param)
    response = await http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": []}, headers=headers)
    assert_openai_error(response, 400, "prompt")


async def test_malformed_json_is_400(served, http):
    url, headers = served
    response = await http.post(f"{url}/v1/chat/completions", content=b"{nope", headers=headers)
    assert_openai_error(response, 400)


async def test_missing_or_wrong_key_is_401(served, http):
    url, _headers = served
    for authorization in (None, "Bearer wrong-key", "Basic abc"):
        headers = {"Authorization": authorization} if authorization else {}
        response = await http.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers)
        assert assert_openai_error(response, 401)["code"] == "invalid_api_key"


async def test_unknown_model_is_404(served, http):
    url, headers = served
    response = await http.post(f"{url}/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=headers)
    assert assert_openai_error(response, 404, "model")["code"] == "model_not_found"


async def test_oversized_body_is_413_and_a_prompt_past_the_context_is_a_400_as_openai_answers(served, http):
    """A prompt longer than the endpoint takes is OpenAI's 400 `context_length_exceeded` (what the SDK raises
    as BadRequestError and clients catch to trim a conversation), as a prompt plus max_tokens past it is."""
    url, headers = served
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert_openai_error(await http.post(f"{url}/v1/chat/completions", json=big, headers=headers), 413)
    long_prompt = {**CHAT, "messages": [{"role": "user", "content": "the cat sat " * 150}]}
    error = assert_openai_error(await http.post(f"{url}/v1/chat/completions", json=long_prompt, headers=headers),
                                400, "messages")
    assert error["code"] == "context_length_exceeded" and "Shorten the messages" in error["message"]
    key = headers["Authorization"].removeprefix("Bearer ")
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=MODEL, prompt="the cat sat " * 150, max_tokens=3)
    assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "prompt")


async def test_request_and_token_rate_limits_are_429_with_retry_after(cluster, make_router, http):
    await cluster.add_site("fra", 50.1, 8.7)
    per_request = await cluster.create_key(requests_per_minute=2)
    per_token = await cluster.create_key(tokens_per_minute=60)
    _router, url = await make_router()
    for _ in range(2):
        response = await http.post(f"{url}/v1/chat/completions", json=CHAT,
                                   headers={"Authorization": f"Bearer {per_request}"})
        assert response.status_code == 200
    response = await http.post(f"{url}/v1/chat/completions", json=CHAT,
                               headers={"Authorization": f"Bearer {per_request}"})
    assert assert_openai_error(response, 429)["code"] == "rate_limit_exceeded"
    assert int(response.headers["retry-after"]) >= 1
    statuses = []
    for _ in range(3):  # each charges ~20 prompt tokens + 3; the third overdraws 60 per minute
        response = await http.post(f"{url}/v1/chat/completions", json=CHAT,
                                   headers={"Authorization": f"Bearer {per_token}"})
        statuses.append(response.status_code)
    assert statuses[0] == 200 and statuses[-1] == 429


async def test_no_capacity_is_503_with_retry_after(cluster, make_router, http):
    await cluster.add_site("fra", 50.1, 8.7, kv_blocks_free=0)
    key = await cluster.create_key()
    _router, url = await make_router()
    response = await http.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
    assert assert_openai_error(response, 503)["code"] == "no_capacity"
    assert "retry-after" in response.headers


async def test_region_limited_key_gets_403_naming_the_regions_when_only_other_regions_serve_the_model(
        cluster, make_router, http):
    await cluster.add_site("fra", 50.1, 8.7, region="eu")
    key = await cluster.create_key(allowed_regions=["us"])
    _router, url = await make_router()
    response = await http.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
    error = assert_openai_error(response, 403, "model")
    assert error["code"] == "model_not_in_allowed_regions" and "us" in error["message"] and "eu" in error["message"]


async def test_unknown_route_is_openai_shaped_404(served, http):
    url, headers = served
    error = assert_openai_error(await http.get(f"{url}/v1/nothing", headers=headers), 404)
    assert "`/v1/nothing`" in error["message"] and "POST /v1/chat/completions" in error["message"]


async def test_a_wrong_method_is_405_saying_which_methods_the_path_takes(served, http):
    url, headers = served
    for method, path, allowed in (("GET", "/v1/chat/completions", "POST"), ("PUT", "/v1/completions", "POST"),
                                  ("POST", "/v1/models", "GET")):
        response = await http.request(method, f"{url}{path}", headers=headers, json={})
        error = assert_openai_error(response, 405)
        assert response.headers["allow"] == allowed  # RFC 9110: a 405 lists the methods the resource takes
        assert f"`{method}` is not allowed on `{path}`; use {allowed}" in error["message"]


async def test_head_is_answered_wherever_get_is_with_the_get_status_and_no_body(served, http):
    """Load balancers and uptime monitors check health with HEAD; RFC 9110 has it wherever GET is."""
    url, headers = served
    for path, auth, status in (("/healthz", {}, 200), ("/v1/models", headers, 200), ("/v1/models", {}, 401),
                               ("/v1/models/missing", headers, 404)):
        get, head = await http.get(f"{url}{path}", headers=auth), await http.head(f"{url}{path}", headers=auth)
        assert get.status_code == head.status_code == status, path
        assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
    response = await http.post(f"{url}/healthz", headers=headers)
    assert response.status_code == 405 and response.headers["allow"] == "GET"  # the HEAD route adds nothing
