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


# Every parameter of the SDK's create() that the router does not implement, with a value a client sends.
UNIMPLEMENTED_CHAT = {
    "audio": {"voice": "alloy", "format": "wav"}, "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto", "moderation": {"model": "x"}, "prediction": {"type": "content", "content": "x"},
    "prompt_cache_options": {"mode": "x"}, "prompt_cache_retention": "24h", "verbosity": "low",
    "web_search_options": {}, "store": True, "service_tier": "flex", "modalities": ["text", "audio"],
}
UNIMPLEMENTED_COMPLETIONS = {"best_of": 2, "suffix": "tail"}


async def test_each_unimplemented_parameter_is_a_400_naming_it(client):
    messages = [{"role": "user", "content": "x"}]
    for name, value in UNIMPLEMENTED_CHAT.items():
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **{name: value})
        assert caught.value.param == name and caught.value.type == "invalid_request_error", name
    for name, value in UNIMPLEMENTED_COMPLETIONS.items():
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=2, **{name: value})
        assert caught.value.param == name, name
    with pytest.raises(openai.BadRequestError) as caught:  # a field no SDK knows
        await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                             extra_body={"guided_json": {"type": "object"}})
    assert caught.value.param == "guided_json"
    image = [{"type": "text", "text": "what is this?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": image}], max_tokens=2)
    assert caught.value.param == "messages[0].content" and "no vision" in caught.value.message
    for change in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
                   {"tool_choice": "required"}, {"logit_bias": {"99999": 5}}, {"presence_penalty": 2.5}):
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **change)


async def test_fields_without_effect_and_text_parts_are_accepted(client):
    parts = [{"type": "text", "text": "where is "}, {"type": "text", "text": "the nearest site?"}]
    completion = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=3, metadata={"team": "a"}, store=False,
        service_tier="auto", modalities=["text"], safety_identifier="u-1", prompt_cache_key="conversation-7",
        user="u-1", n=2, presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"5": 1.5},
        extra_body={"min_p": 0.05, "top_k": 20})
    assert [c.index for c in completion.choices] == [0, 1]
