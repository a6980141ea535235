"""Who may call a router: every route against every credential; and what a router presents to agents.

Only a live API key opens the /v1 routes; the fleet's other tokens (admin, router, site, agent, peer)
are not API keys. A refusal is a 401 with an OpenAI error body and `WWW-Authenticate: Bearer`, as the
official client reads it (openai.AuthenticationError). Towards agents a router presents its
`agent_token`; agents split by role refuse their peer token from it (node_agent.auth).
"""

from __future__ import annotations

import logging

import openai
import pytest
from router_fake_agent import MODEL

from node_agent.auth import token_digest
from node_agent.config import AgentConfig
from node_agent.daemon import Agent
from router.config import ConfigError, RouterConfig

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
    _router, url = await make_router(max_body_bytes=4096, agent_token="efag-agent-token")
    credentials = {"admin": ADMIN_TOKEN, "router": ROUTER_TOKEN, "site": site_token, "agent": "efag-agent-token",
                   "peer": "efp-peer-token", "revoked": revoked["key"], "unknown": "ef-" + "x" * 43}
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


# -- what a router presents to agents ---------------------------------------------------------------

AGENT_TOKEN, AGENT_PEER_TOKEN = "efag-agent-token", "efp-agent-peer-token"
PREFILL_SITE, DECODE_SITE = "lis", "fra"


@pytest.fixture
async def split_sites(cluster, tiny_model_dir):
    """Two real agents split by role: one prefills only, one decodes only, so every request is split."""
    agents = []
    for name, role, lat, lon in ((PREFILL_SITE, "prefill", 38.7, -9.1), (DECODE_SITE, "decode", 50.1, 8.7)):
        agent = Agent(AgentConfig(site=name, role=role, models={MODEL: str(tiny_model_dir)}, grpc_listen="127.0.0.1:0",
                                  metrics_listen=None, peer_token=AGENT_PEER_TOKEN,
                                  agent_token_sha256=token_digest(AGENT_TOKEN), kv_cache_bytes=4 << 20,
                                  device="cpu", dtype="float32"))
        await agent.start()
        agents.append(agent)
        await cluster.admin.create_site(name, region="eu", country="XX", lat=lat, lon=lon,
                                        grpc_address=agent.address, models=[{"model": MODEL, "role": role}],
                                        heartbeat_interval_s=60)
        await cluster.heartbeat(name)
    yield {agent.config.site: agent for agent in agents}
    for agent in agents:
        await agent.stop()


async def test_a_router_with_the_agent_token_serves_a_split_request(cluster, make_router, split_sites, http):
    _router, url = await make_router(agent_token=AGENT_TOKEN, first_token_timeout_s=30, token_idle_timeout_s=30)
    key = await cluster.create_key()
    response = await http.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                               json={"model": MODEL, "prompt": "hello there", "max_tokens": 6, "temperature": 0})
    assert response.status_code == 200, response.text
    assert (response.headers["x-edgefire-prefill-site"], response.headers["x-edgefire-decode-site"]) == \
        (PREFILL_SITE, DECODE_SITE)
    assert response.json()["usage"]["completion_tokens"] == 6
    decode_site = split_sites[DECODE_SITE]
    assert decode_site.metrics.kv_bytes_received._value.get() > 0  # pulled with the peer token, not recomputed
    assert decode_site.metrics.kv_fallbacks._value.get() == 0


async def test_a_router_holding_the_agents_peer_token_is_refused_by_split_agents(cluster, make_router, split_sites,
                                                                                  http):
    """The peer token every site holds does not let its holder act as a router."""
    _router, url = await make_router(peer_token=AGENT_PEER_TOKEN)
    key = await cluster.create_key()
    response = await http.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                               json={"model": MODEL, "prompt": "hello there", "max_tokens": 6})
    assert response.status_code == 503, response.text
    assert AGENT_PEER_TOKEN not in response.text
    assert all(site.core.num_inflight == 0 for site in split_sites.values())


def test_router_agent_token_settings():
    assert RouterConfig(agent_token="a").validate().agent_credential == "a"
    assert RouterConfig(peer_token="p").validate().agent_credential == "p"  # the old name, still sent
    with pytest.raises(ConfigError, match="peer_token: a router sends agents one token, agent_token"):
        RouterConfig(agent_token="a", peer_token="p").validate()


async def test_a_router_with_the_old_peer_token_name_warns(cluster, make_router, caplog):
    with caplog.at_level(logging.WARNING, logger="router.server"):
        await make_router(peer_token="efp-peer-token")
    assert "peer_token is the old name of agent_token" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="router.server"):
        await make_router(agent_token="efag-agent-token")
    assert "old name" not in caplog.text
