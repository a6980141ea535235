"""The official `openai` client, streaming and not, against the router."""

from __future__ import annotations

import openai
import pytest
from router_fake_agent import MODEL


@pytest.fixture
async def client(cluster, make_router):
    await cluster.add_site("fra", 50.1, 8.7)
    key = await cluster.create_key()
    _router, url = await make_router()
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        yield client


async def test_chat_completion_streamed_and_not_agree(client):
    messages = [{"role": "user", "content": "where is the nearest site?"}]
    completion = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    text = completion.choices[0].message.content
    assert text and completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 8
    assert completion.usage.prompt_tokens_details.cached_tokens == 0
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == text
    assert usage.total_tokens == completion.usage.total_tokens


async def test_completions_with_stop_string_and_logprobs(client):
    full = await client.completions.create(model=MODEL, prompt="edge sites", max_tokens=10, temperature=0)
    words = full.choices[0].text.split(" ")
    stop = " " + words[3]  # a stop string that spans a word boundary in the middle of the text
    cut = await client.completions.create(model=MODEL, prompt="edge sites", max_tokens=10, temperature=0,
                                          stop=[stop], logprobs=1)
    assert cut.choices[0].text == full.choices[0].text[:full.choices[0].text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].logprobs.token_logprobs


async def test_models_and_errors_through_the_client(client):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "edgefire"
    assert models.data[0].model_extra["max_model_len"] == 1024  # the context length the site reported
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=17)
