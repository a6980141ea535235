"""The router over TLS: HTTPS for clients, TLS (with a client certificate) to agents, nothing in clear."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from router_fake_agent import MODEL

from node_agent.tls import client_context, server_credentials

STOP_GUARD_S = 15.0  # a hang guard, not a measurement: without the fix the stop takes asyncio's 30 s TLS close


@pytest.fixture
async def tls_site(cluster, local_tls):
    """A site whose agent speaks only TLS and demands a client certificate signed by the local CA."""
    return await cluster.add_site("fra", 50.1, 8.7,
                                  credentials=server_credentials(local_tls.cert, local_tls.key, local_tls.ca))


async def test_https_router_calls_tls_agents_with_a_client_certificate(cluster, make_router, local_tls, tls_site):
    key = await cluster.create_key()
    _router, url = await make_router(tls_cert=local_tls.cert, tls_key=local_tls.key, tls_ca=local_tls.ca,
                                     agent_tls=True, agent_client_cert=local_tls.cert,
                                     agent_client_key=local_tls.key)
    assert url.startswith("https://")
    async with httpx.AsyncClient(verify=client_context(local_tls.ca)) as http, \
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, http_client=http) as client:
        completion = await client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0,
                                                          messages=[{"role": "user", "content": "over TLS"}])
    assert completion.choices[0].message.content and completion.usage.completion_tokens == 6

    plain_url = url.replace("https://", "http://")
    async with httpx.AsyncClient() as plain:  # a client speaking HTTP to the HTTPS port gets nothing
        with pytest.raises(httpx.HTTPError):
            await plain.get(f"{plain_url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    async with httpx.AsyncClient() as unverified:  # nor does one that cannot verify the router's certificate
        with pytest.raises(httpx.ConnectError):
            await unverified.get(f"{url}/v1/models")


async def test_router_without_a_client_certificate_is_refused_by_the_agent(cluster, make_router, http, local_tls,
                                                                          tls_site):
    key = await cluster.create_key()
    _router, url = await make_router(tls_ca=local_tls.ca, agent_tls=True)
    response = await http.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                               json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
    assert response.status_code == 503, response.text


async def test_https_router_stops_while_a_keep_alive_client_idles(cluster, make_router, local_tls):
    """An idle TLS client never sends its TLS close: the router must not wait for it (30 s) to stop."""
    router, url = await make_router(tls_cert=local_tls.cert, tls_key=local_tls.key, require_api_key=False)
    async with httpx.AsyncClient(verify=client_context(local_tls.ca)) as idle:
        assert (await idle.get(f"{url}/healthz")).status_code == 200  # its connection stays open, idle
        await asyncio.wait_for(router.stop(), STOP_GUARD_S)  # raises TimeoutError if the router waits for it
