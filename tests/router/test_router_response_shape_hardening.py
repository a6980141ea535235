"""What OpenAI clients read from the router's answers: the official `openai` client and raw HTTP."""

from __future__ import annotations

import openai
import pytest
from router_fake_agent import MODEL

FRA, PAR = (50.1, 8.7), (48.86, 2.35)
MESSAGES = [{"role": "user", "content": "tell me about edge sites"}]


@pytest.fixture
async def two_sites(cluster, make_router):
    near = await cluster.add_site("fra", *FRA)
    far = await cluster.add_site("par", *PAR)
    key = await cluster.create_key()
    _router, url = await make_router()
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        yield near, far, client


async def test_a_stream_of_several_choices_that_breaks_raises_the_stream_error_in_the_client(two_sites):
    near, far, client = two_sites
    near.die_after = far.die_after = 2
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                                  n=2, stream=True)
    finishes = []
    with pytest.raises(openai.APIError) as raised:
        async for chunk in stream:
            finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
    assert not isinstance(raised.value, openai.APIConnectionError)
    assert raised.value.code == "stream_interrupted"
    assert finishes == []


async def test_max_tokens_and_max_completion_tokens_that_disagree_are_a_400_not_one_silently_winning(client):
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, max_completion_tokens=5)
    assert caught.value.param == "max_tokens" and caught.value.code == "invalid_parameter_combination"
    assert "max_completion_tokens" in caught.value.message
    same = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, max_completion_tokens=4,
                                                temperature=0)
    assert same.usage.completion_tokens == 4 and same.choices[0].finish_reason == "length"


async def test_a_limit_past_the_context_names_the_parameter_the_client_sent(client):
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=5000)
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.param == "max_completion_tokens" and "lower max_completion_tokens" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5000)
    assert caught.value.param == "max_tokens" and "lower max_tokens" in caught.value.message


async def test_completion_text_offsets_point_at_each_token_while_a_stop_string_holds_text_back(client):
    """A stop string holds back as much text as it is long, so a chunk carries tokens whose text is sent
    later: each token's text_offset is still where that token's text starts in the choice's text."""
    prompt, stop = "edge sites", "never-in-the-text"
    whole = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=1,
                                            stop=[stop])
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=1,
                                             stop=[stop], stream=True)
    pieces, tokens, offsets = [], [], []
    async for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.text)
            if choice.logprobs:
                tokens += choice.logprobs.tokens
                offsets += choice.logprobs.text_offset
    choice = whole.choices[0]
    assert "".join(pieces) == choice.text and tokens == choice.logprobs.tokens and len(tokens) == 10
    assert offsets == choice.logprobs.text_offset
    assert [choice.text[o:o + len(t)] for o, t in zip(offsets, tokens)] == tokens


async def test_a_router_failure_after_the_first_chunk_reaches_the_client_as_an_error_event(client, monkeypatch):
    from router import responses

    calls = []

    def failing_logprobs(*args, **kwargs):
        calls.append(args)
        if len(calls) > 2:
            raise RuntimeError("a bug in the router")
        return chat_logprobs(*args, **kwargs)

    chat_logprobs = responses.chat_logprobs
    monkeypatch.setattr(responses, "chat_logprobs", failing_logprobs)
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, logprobs=True,
                                                  stream=True)
    pieces = []
    with pytest.raises(openai.APIError) as raised:
        async for chunk in stream:
            pieces += [c.delta.content for c in chunk.choices if c.delta.content]
    assert not isinstance(raised.value, openai.APIConnectionError)
    assert raised.value.code == "internal_error" and "request id req-" in raised.value.message
    assert len(pieces) == 2
