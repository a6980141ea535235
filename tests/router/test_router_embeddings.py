"""POST /v1/embeddings end to end: the official `openai` client, a router, and real agents whose engines embed
(the tiny demo Llama: no sentence-transformers files, so last-token pooling, L2-normalized), checked against
transformers; failover from a site that is down; the 400s for bad input."""

from __future__ import annotations

import base64
import socket

import grpc
import httpx
import numpy as np
import openai
import pytest
from prometheus_client import generate_latest
import torch

from engine.tokenizer import ChatTokenizer
from node_agent.client import AgentClient
from node_agent.config import AgentConfig
from node_agent.daemon import Agent
from tests.metrics_text import Samples

MODEL = "embed-model"
PEER_TOKEN = "peer-secret"
PORT_RANGE = range(49600, 49790)   # this file's ports; outgoing connections may hold some of them a while


def free_port() -> int:
    for port in PORT_RANGE:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")
DEAD_ADDRESS = "127.0.0.1:49799"   # nothing listens here: the site is down


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """embed(text or ids) -> transformers' last hidden state of the last token, normalized."""
    import transformers
    model = transformers.AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = ChatTokenizer.from_dir(tiny_model_dir)

    def embed(item) -> torch.Tensor:
        ids = tokenizer.encode(item) if isinstance(item, str) else item
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden, dim=0)

    embed.tokenizer = tokenizer
    embed.hidden_size = model.config.hidden_size
    return embed


@pytest.fixture
async def sites(cluster, tiny_model_dir):
    """add(name, lat, lon, dead=False): a registered site whose agent really embeds (or is down)."""
    agents: list[Agent] = []

    async def add(name: str, lat: float, lon: float, dead: bool = False) -> None:
        address = DEAD_ADDRESS
        if not dead:
            config = AgentConfig(site=name, models={MODEL: str(tiny_model_dir)}, grpc_listen=f"127.0.0.1:{free_port()}",
                                 metrics_listen=None, peer_token=PEER_TOKEN, kv_cache_bytes=4 << 20, device="cpu",
                                 dtype="float32")
            config.validate()
            agent = Agent(config)
            await agent.start()
            agents.append(agent)
            address = agent.address
        await cluster.admin.create_site(name, region="eu", country="XX", lat=lat, lon=lon, grpc_address=address,
                                        models=[{"model": MODEL, "role": "both"}], heartbeat_interval_s=60)
        await cluster.heartbeat(name)

    add.agents = agents
    yield add
    for agent in agents:
        await agent.stop()


@pytest.fixture
async def endpoint(cluster, make_router, sites):
    """(router, base url, API key) with a dead site nearest the router (Frankfurt) and a live one further."""
    await sites("fra", 50.1, 8.7, dead=True)
    await sites("waw", 52.2, 21.0)
    key = await cluster.create_key()
    router, url = await make_router(port=free_port(), agent_token=PEER_TOKEN)
    return router, url, key


async def test_openai_client_embeds_as_transformers_after_failing_over(endpoint, reference, sites):
    router, url, key = endpoint
    texts = ["where is the nearest site?", "edge", "a longer sentence about routers and their many sites"]
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        answer = await client.embeddings.create(model=MODEL, input=texts)
        assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == MODEL
        for datum, text in zip(answer.data, texts):
            torch.testing.assert_close(torch.tensor(datum.embedding), reference(text), atol=2e-5, rtol=1e-4)
        num_tokens = sum(len(reference.tokenizer.encode(t)) for t in texts)
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == num_tokens

        # base64 (the SDK's default when no format is named, decoded by it) and float agree
        raw = await client.embeddings.with_raw_response.create(model=MODEL, input="edge", encoding_format="base64")
        assert raw.headers["x-edgefire-prefill-site"] == "waw"
        vector = np.frombuffer(base64.b64decode(raw.parse().data[0].embedding), dtype="<f4")
        torch.testing.assert_close(torch.from_numpy(vector.copy()), reference("edge"), atol=2e-5, rtol=1e-4)
        decoded = await client.embeddings.create(model=MODEL, input="edge")   # SDK: base64 on the wire
        torch.testing.assert_close(torch.tensor(decoded.data[0].embedding), reference("edge"), atol=2e-5, rtol=1e-4)

        # dimensions: the first values, re-normalized (the model normalizes)
        cut = await client.embeddings.create(model=MODEL, input="edge", dimensions=8, encoding_format="float")
        expected = torch.nn.functional.normalize(reference("edge")[:8], dim=0)
        torch.testing.assert_close(torch.tensor(cut.data[0].embedding), expected, atol=2e-5, rtol=1e-4)

        # token ids: one list, and a list of lists
        ids = reference.tokenizer.encode("edge")
        one = await client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
        many = await client.embeddings.create(model=MODEL, input=[ids, [5, 6, 7]], encoding_format="float")
        torch.testing.assert_close(torch.tensor(one.data[0].embedding), reference(ids), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(many.data[1].embedding), reference([5, 6, 7]), atol=2e-5, rtol=1e-4)
        assert many.usage.prompt_tokens == len(ids) + 3
    samples = Samples.parse(generate_latest(router.metrics.registry).decode())
    assert samples.get("edgefire_router_requests_total", model=MODEL, route="embeddings", status="200") == 6
    assert samples.get("edgefire_router_site_failures_total", site="fra", reason="unavailable") >= 1
    (agent,) = sites.agents   # the live site counts every input it embedded and their prompt tokens
    at_site = Samples.parse(generate_latest(agent.core.metrics.registry).decode())
    assert at_site.get("edgefire_agent_embeddings_total", model=MODEL) == 3 + 1 + 1 + 1 + 1 + 2
    assert at_site.get("edgefire_agent_prompt_tokens_total", model=MODEL) == num_tokens + 5 * len(ids) + 3


@pytest.mark.parametrize("body, status, param", [
    ({"input": ""}, 400, "input[0]"),
    ({"input": []}, 400, "input"),
    ({"input": ["fine", ""]}, 400, "input[1]"),
    ({"input": [[1, 2], []]}, 400, "input[1]"),
    ({"input": ["text", [1, 2]]}, 400, "input[1]"),
    ({"input": [1.5]}, 400, "input[0]"),
    ({"input": {"text": "x"}}, 400, "input"),
    ({}, 400, "input"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "dimensions": 0}, 400, "dimensions"),
    ({"input": "x", "dimensions": 100000}, 400, "dimensions"),
    ({"input": "x", "user": 5}, 400, "user"),
    ({"input": "x", "n": 2}, 400, "n"),
    ({"input": [[10 ** 6]]}, 400, "input"),
    ({"input": "word " * 5000}, 400, "input"),
])
async def test_bad_input_is_a_400_naming_the_field(endpoint, body, status, param):
    _router, url, key = endpoint
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(f"{url}/v1/embeddings", json={"model": MODEL, **body},
                                   headers={"authorization": f"Bearer {key}"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    if body.get("input") == "word " * 5000:
        assert error["code"] == "context_length_exceeded"


async def test_unknown_model_and_missing_key(endpoint):
    _router, url, key = endpoint
    async with httpx.AsyncClient(timeout=30) as http:
        unknown = await http.post(f"{url}/v1/embeddings", json={"model": "nope", "input": "x"},
                                  headers={"authorization": f"Bearer {key}"})
        no_key = await http.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert no_key.status_code == 401


def full_site_error() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                "KV pool is full: the request needs 2 blocks, 0 of 64 are free")


async def test_a_full_site_is_waited_for_as_completions_wait(endpoint, monkeypatch):
    """The only live site is full at first: the request waits for room instead of answering 503 at once; a site
    full for longer than max_full_wait_s (5 s by default; 2 s here, the first-token timeout) gets the 503."""
    router, url, key = endpoint
    real_embed, refusals = AgentClient.embed, []

    async def full_twice(self, request, timeout=None):
        if len(refusals) < 2:
            refusals.append(request.request_id)
            raise full_site_error()
        return await real_embed(self, request, timeout)

    monkeypatch.setattr(AgentClient, "embed", full_twice)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        answer = await client.embeddings.create(model=MODEL, input="edge", encoding_format="float")
        assert len(answer.data[0].embedding) > 0 and len(refusals) == 2

        async def always_full(self, request, timeout=None):
            raise full_site_error()

        monkeypatch.setattr(AgentClient, "embed", always_full)
        with pytest.raises(openai.InternalServerError) as refused:   # 503, after the wait
            await client.embeddings.create(model=MODEL, input="edge")
        assert refused.value.status_code == 503 and "full" in refused.value.message
