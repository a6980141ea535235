"""The official `openai` client, streaming and not, against the router."""

from __future__ import annotations

import openai
import pytest
from router_fake_agent import MODEL

from engine.tokenizer import ChatTokenizer


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


async def test_an_answer_ending_inside_a_message_of_several_tokens_ends_at_its_stop(cluster, client):
    """A speculating site sends a step's tokens in one message: a stop string reached inside it ends the
    answer there, its usage and logprobs counting none of the tokens after it, as with one token a message."""
    messages = [{"role": "user", "content": "where is the nearest site?"}]
    full = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    words = full.choices[0].message.content.split(" ")
    stop = " " + words[6]   # reached at the 6th token: inside the second message of four tokens
    results = []
    for tokens_per_chunk in (1, 4):
        cluster.agents["fra"].tokens_per_chunk = tokens_per_chunk
        whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                     stop=[stop], logprobs=True)
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                      stop=[stop], logprobs=True, stream=True,
                                                      stream_options={"include_usage": True})
        pieces, entries, usage, finish = [], [], None, None
        async for chunk in stream:
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                entries += choice.logprobs.content if choice.logprobs else []
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage
        choice = whole.choices[0]
        assert choice.finish_reason == finish == "stop"
        assert "".join(pieces) == choice.message.content == full.choices[0].message.content.split(stop)[0]
        assert len(entries) == len(choice.logprobs.content) == whole.usage.completion_tokens == usage.completion_tokens
        results.append((choice.message.content, whole.usage.completion_tokens,
                        [e.token for e in choice.logprobs.content]))
    assert results[0] == results[1] and results[0][1] == 6


async def test_models_and_errors_through_the_client(client):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "edgefire"
    assert models.data[0].model_extra["max_model_len"] == 1024  # the context length the site reported
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=17)


async def test_a_model_is_retrieved_by_its_id_through_the_client(client):
    model = await client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "edgefire")
    assert model.model_extra["max_model_len"] == 1024
    for missing in ("missing", "org/missing"):  # ids of Hugging Face checkpoints hold a slash
        with pytest.raises(openai.NotFoundError) as caught:
            await client.models.retrieve(missing)
        assert caught.value.code == "model_not_found" and f"`{missing}`" in caught.value.message


async def test_an_answer_whose_characters_span_tokens_keeps_every_byte(cluster, make_router, tiny_model_dir):
    """Byte-level tokens split "日本" in six. The logprobs' `bytes` join into the answer's UTF-8 (each token's own
    bytes, not those of the U+FFFD its text alone decodes to), and an answer cut inside a character by
    max_tokens ends as a full decode of its tokens does, streamed or not, rather than losing them."""
    tokenizer = ChatTokenizer.from_dir(tiny_model_dir)
    ids = tokenizer.encode("ok 日本", add_special_tokens=False)
    agent = await cluster.add_site("fra", 50.1, 8.7)
    agent.token_at = lambda _prompt_ids, position: ids[position]
    _router, url = await make_router()
    messages = [{"role": "user", "content": "x"}]
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=await cluster.create_key(), max_retries=0) as client:
        whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=len(ids),
                                                     logprobs=True, top_logprobs=1)
        entries = whole.choices[0].logprobs.content
        assert whole.choices[0].message.content == "ok 日本"
        assert b"".join(bytes(e.bytes) for e in entries).decode() == "ok 日本"
        assert all(e.top_logprobs[0].bytes == e.bytes for e in entries)  # the fake's one alternative is the token
        cut = len(ids) - 1
        expected = tokenizer.decode(ids[:cut])
        short = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=cut)
        assert short.choices[0].message.content == expected and expected.endswith("\ufffd")
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=cut, stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in stream]) == expected


# Every parameter of the SDK's create() that the router does not implement, with a value a client sends.
UNIMPLEMENTED_CHAT = {
    "audio": {"voice": "alloy", "format": "wav"}, "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto", "moderation": {"model": "x"},
    "prompt_cache_options": {"mode": "x"}, "prompt_cache_retention": "24h", "verbosity": "low",
    "web_search_options": {}, "store": True, "service_tier": "turbo", "modalities": ["text", "audio"],
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
