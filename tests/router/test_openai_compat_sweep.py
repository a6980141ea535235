"""OpenAI API compatibility through the official `openai` client: request fields OpenAI accepts that the
router read wrongly or refused (assistant refusals, negative seeds, `allowed_tools`), the legacy fields it
cannot honour refused by name, and the stream and response shapes the client parses."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from router_fake_agent import MODEL, model_info_from_dir

from tests.engine.chat_checkpoints import TEMPLATES, write_template_tokenizer

QWEN3 = "Qwen-Qwen3-0.6B"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


@pytest.fixture
async def qwen3(cluster, make_router, tmp_path):
    """(the site's fake agent, the official client, transformers' tokenizer) for a Qwen3-templated model."""
    directory = tmp_path / "qwen3"
    write_template_tokenizer(directory, QWEN3)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(directory))
    eos = hf.convert_tokens_to_ids(TEMPLATES[QWEN3][1])
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    info = model_info_from_dir(directory)
    info.chat_template = (directory / "chat_template.jinja").read_text()
    cluster.model_info = info
    agent = await cluster.add_site("fra", 50.1, 8.7)
    key = await cluster.create_key()
    _router, url = await make_router()
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        yield agent, client, hf


@pytest.fixture
async def client(cluster, make_router):
    agent = await cluster.add_site("fra", 50.1, 8.7)
    key = await cluster.create_key()
    _router, url = await make_router()
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        yield agent, client, url, key


def _last_request(agent):
    return next(request for method, request in reversed(agent.calls) if method != "GetModelInfo")


def _rendered(hf, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    return hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=False)


async def test_an_assistant_refusal_reaches_the_model_as_what_the_assistant_said(qwen3):
    """OpenAI's own replies carry a refusal as `refusal` (content null) or as a refusal part; replayed, the
    model reads that turn as the refusal's text, not as an empty turn or a 400."""
    agent, client, hf = qwen3
    refusal = "I can't help with that."
    as_text = [{"role": "user", "content": "Pick a lock."}, {"role": "assistant", "content": refusal},
               {"role": "user", "content": "A bike lock, mine."}]
    for turn in ({"role": "assistant", "content": None, "refusal": refusal},
                 {"role": "assistant", "content": [{"type": "refusal", "refusal": refusal}]}):
        messages = [as_text[0], turn, as_text[2]]
        await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
        assert list(_last_request(agent).prompt_ids) == _rendered(hf, as_text), turn
    with pytest.raises(openai.BadRequestError) as caught:  # a user does not refuse
        await client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "refusal", "refusal": refusal}]}])
    assert caught.value.param == "messages[0].content"


async def test_a_legacy_function_call_in_the_history_is_refused_by_name(client):
    """A deprecated `function_call` on an assistant turn was dropped, so the model never saw the call."""
    _agent, client, _url, _key = client
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "function_call": {"name": "get_weather",
                                                                         "arguments": "{\"city\": \"Oslo\"}"}},
                {"role": "user", "content": "And?"}]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert caught.value.param == "messages[1].function_call" and "tool_calls" in caught.value.message
    assert caught.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as caught:  # audio and other non-text parts name their type
        await client.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}])
    assert caught.value.param == "messages[0].content" and "`input_audio`" in caught.value.message


async def test_a_negative_seed_is_accepted_and_reproducible(client):
    """OpenAI takes any int64 seed; -1 was a 400. It reaches the site folded into the engines' range."""
    agent, client, _url, _key = client
    texts, seeds = [], []
    for _ in range(2):
        completion = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=-1)
        texts.append(completion.choices[0].message.content)
        seeds.append(_last_request(agent).sampling.seed)
    assert texts[0] == texts[1] and seeds == [2 ** 63 - 1] * 2
    completion = await client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2, seed=-2 ** 63)
    assert [c.index for c in completion.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=2, seed=-2 ** 63 - 1)
    assert caught.value.param == "seed"


async def test_allowed_tools_offers_the_model_only_the_tools_it_names(qwen3):
    """`tool_choice: {"type": "allowed_tools"}` (openai >= 1.99) was a 400; the model now sees only the
    allowed tools, and mode "required" forces a call of one of them."""
    agent, client, hf = qwen3
    messages = [{"role": "user", "content": "What time is it in Oslo?"}]
    allowed = {"type": "function", "function": {"name": "get_time"}}
    await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, tools=[WEATHER, TIME],
                                         tool_choice={"type": "allowed_tools",
                                                      "allowed_tools": {"mode": "auto", "tools": [allowed]}})
    assert list(_last_request(agent).prompt_ids) == _rendered(hf, messages, [TIME])
    await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, tools=[WEATHER, TIME],
                                         tool_choice={"type": "allowed_tools",
                                                      "allowed_tools": {"mode": "required", "tools": [allowed]}})
    request = _last_request(agent)
    assert list(request.prompt_ids) == _rendered(hf, messages, [TIME])
    grammar = str(request.sampling.grammar)
    assert "get_time" in grammar and "get_weather" not in grammar
    unknown = [{"type": "function", "function": {"name": "get_date"}}]
    for tools, param in ((unknown, "tool_choice.allowed_tools.tools[0]"), ([], "tool_choice.allowed_tools")):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, tools=[WEATHER, TIME],
                                                 tool_choice={"type": "allowed_tools",
                                                              "allowed_tools": {"mode": "auto", "tools": tools}})
        assert caught.value.param == param


async def test_streamed_choices_logprobs_and_usage_parse_as_the_client_types_them(client):
    """n=2 with logprobs and include_usage: one id, one `created`, chunk objects throughout, the final usage
    chunk with no choices; the assembled text equals the non-streamed answer's."""
    _agent, client, url, key = client
    fields = dict(model=MODEL, messages=[{"role": "developer", "content": "Be brief."},
                                         {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ana"}],
                  max_completion_tokens=4, n=2, seed=7, logprobs=True, top_logprobs=2, stop=None)
    whole = await client.chat.completions.create(**fields)
    stream = await client.chat.completions.create(**fields, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert {(c.id, c.created, c.object) for c in chunks} == {(chunks[0].id, chunks[0].created, "chat.completion.chunk")}
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump() | {
        "prompt_tokens_details": chunks[-1].usage.prompt_tokens_details.model_dump()}
    for choice in whole.choices:
        pieces = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(p.delta.content or "" for p in pieces) == choice.message.content
        streamed_lp = [e for p in pieces if p.logprobs for e in p.logprobs.content]
        assert [e.model_dump() for e in streamed_lp] == [e.model_dump() for e in choice.logprobs.content]
        assert pieces[-1].finish_reason == choice.finish_reason in ("stop", "length")
    async with httpx.AsyncClient() as http:  # raw: the terminator and no unknown top-level keys
        response = await http.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                   json={**fields, "stream": True, "stream_options": {"include_usage": True}})
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    assert {key for event in events[:-1] for key in json.loads(event)} <= {
        "id", "object", "created", "model", "choices", "usage", "system_fingerprint", "service_tier"}
