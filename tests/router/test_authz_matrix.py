"""Who may call a router: every route against every credential.

Only a live API key opens the /v1 routes; the fleet's other tokens (admin, router, site, peer) are
not API keys. A refusal is a 401 with an OpenAI error body and `WWW-Authenticate: Bearer`, as the
official client reads it (openai.AuthenticationError).
"""

from __future__ import annotations

import openai
import pytest
from router_fake_agent import MODEL

ADMIN_TOKEN, ROUTER_TOKEN = "admin-secret", "router-secret"  # the cluster fixture's registry tokens
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CALLS = [("GET", "/v1/models", None), ("HEAD", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
         ("GET", "/v1/models/no-such-model", None), ("POST", "/v1/chat/completions", CHAT),
         ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})]


@pytest.fixture
async def served(cluster, make_router):
    await cluster.add_site("fra", 50.1, 8.7)
    site_token = (await cluster.admin.issue_site_token("fra"))["token"]
    revoked = await cluster.admin.create_api_key("revoked")
    await cluster.admin.revoke_api_key(revoked["id"])
    _router, url = await make_router(max_body_bytes=4096, peer_token="efp-peer-token")
    credentials = {"admin": ADMIN_TOKEN, "router": ROUTER_TOKEN, "site": site_token, "peer": "efp-peer-token",
                   "revoked": revoked["key"], "unknown": "ef-" + "x" * 43}
    return url, await cluster.create_key(), credentials


def assert_refused(response, label) -> None:
    assert response.status_code == 401, (label, response.text)
    assert response.headers["www-authenticate"] == "Bearer", label
    if response.request.method != "HEAD":
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key", label


async def test_only_a_live_api_key_opens_the_v1_routes(served, http):
    url, key, credentials = served
    for method, path, body in CALLS:
        accepted = await http.request(method, url + path, json=body, headers={"Authorization": f"Bearer {key}"})
        assert accepted.status_code in (200, 404), (path, accepted.text)
        assert_refused(await http.request(method, url + path, json=body), (path, "none"))
        for role, token in credentials.items():
            response = await http.request(method, url + path, json=body, headers={"Authorization": f"Bearer {token}"})
            assert_refused(response, (path, role))
            assert token not in response.text


@pytest.mark.parametrize("authorization", ["Bearer", "Basic a2V5", "Token {key}", "{key}", "Bearer{key}"])
async def test_malformed_headers_are_refused(served, http, authorization):
    url, key, _credentials = served
    response = await http.post(f"{url}/v1/chat/completions", json=CHAT,
                               headers={"Authorization": authorization.format(key=key)})
    assert_refused(response, authorization)


async def test_two_authorization_headers_are_refused_whichever_holds_the_key(served, http):
    """Which of two headers a hop in between added is not knowable, so neither is trusted (as the
    registry and the agents refuse them); the completion routes read the header in front of FastAPI."""
    url, key, credentials = served
    for method, path, body in CALLS:
        for pair in ([key, key], [key, credentials["unknown"]], [credentials["unknown"], key]):
            headers = [("Authorization", f"Bearer {value}") for value in pair]
            response = await http.request(method, url + path, json=body, headers=headers)
            assert_refused(response, (path, pair))
            if method != "HEAD":
                assert "more than one Authorization header" in response.json()["error"]["message"], path
            assert key not in response.text


async def test_the_scheme_is_case_insensitive_and_the_key_trimmed(served, http):
    url, key, _credentials = served
    for authorization in (f"bearer {key}", f"BEARER {key}", f"Bearer  {key}"):
        response = await http.get(f"{url}/v1/models", headers={"Authorization": authorization})
        assert response.status_code == 200, authorization


async def test_a_key_outside_the_authorization_header_is_not_a_credential(served, http):
    url, key, _credentials = served
    assert_refused(await http.get(f"{url}/v1/models?api_key={key}"), "query")
    assert_refused(await http.get(f"{url}/v1/models", headers={"x-api-key": key}), "x-api-key")


async def test_the_official_client_sees_an_authentication_error(served):
    url, _key, credentials = served
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=credentials["admin"], max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as refused:
            await client.chat.completions.create(**CHAT)
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert credentials["admin"] not in str(refused.value)
