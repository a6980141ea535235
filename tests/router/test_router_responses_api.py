"""`POST /v1/responses` through the official `openai` client's `responses` API: the answers of the chat
endpoint (the same machinery serves both) as Response objects and as the Responses' semantic stream events.

Text, tools and structured output run on a real engine (the structured tests' in-process agent on a
random-weight checkpoint with Qwen2.5's chat template and Hermes tool calls); reasoning, mid-stream resume and
a stream that fails for good run on scripted fake agents (Qwen3's template), as the reasoning tests do.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest
from router_fake_agent import MODEL as FAKE

from tests.router.test_router_reasoning import _checkpoint, _client, _ids
from tests.router.test_router_structured import ADD, MODEL, SCHEMAS, WEATHER, _build, serving

QUESTION = "What is the weather in Oslo?"
# The structured tests' chat tools, flat as the Responses API takes them (strict, as the SDK's default sends)
TOOLS = [{"type": "function", **tool["function"], "strict": True} for tool in (WEATHER, ADD)]
CHAT_TOOLS = [{"type": "function", "function": {**tool["function"], "strict": True}} for tool in (WEATHER, ADD)]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("qwen-noise"))


@pytest.fixture
async def served(cluster, make_router, qwen_dir):
    """An `openai` client of a router in front of a real agent serving the Qwen2.5-templated checkpoint."""
    async with serving(cluster, make_router, qwen_dir, MODEL) as (client, _engine):
        yield client


async def _events(stream) -> list:
    return [event async for event in stream]


def _check_sequence(events: list) -> None:
    """Sequence numbers count from 0; created and in_progress come first, one terminal event last."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert all(e.response.id == events[0].response.id for e in events if hasattr(e, "response"))


async def test_text_answers_as_the_chat_endpoint_streamed_and_not(served):
    client = served
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                temperature=0, max_tokens=12)
    response = await client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=12)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.output_text == chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "length"  # a noise model: cut by max_output_tokens
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message" and response.output[0].status == "incomplete"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.max_output_tokens == 12 and response.temperature == 0

    events = await _events(await client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                                         max_output_tokens=12, stream=True))
    _check_sequence(events)
    assert [e.type for e in events[2:4]] == ["response.output_item.added", "response.content_part.added"]
    assert [e.type for e in events[-4:-1]] == ["response.output_text.done", "response.content_part.done",
                                               "response.output_item.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text == events[-4].text
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.output_text == deltas
    assert final.usage.output_tokens == 12 and final.incomplete_details.reason == "max_output_tokens"

    # A conversation given as items, instructions first: the chat endpoint's system message and turns.
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "Rain."}, {"role": "user", "content": "And tomorrow?"}]
    chat = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=10)
    items = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rain."}]},
             {"type": "message", "role": "user", "content": "And tomorrow?"}]
    async with client.responses.stream(model=MODEL, instructions="Answer briefly.", input=items, temperature=0,
                                       max_output_tokens=10) as stream:
        deltas = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
    assert deltas == chat.choices[0].message.content
    response = await client.responses.create(model=MODEL, instructions="Answer briefly.", input=items, temperature=0,
                                             max_output_tokens=10)
    assert response.output_text == deltas and response.instructions == "Answer briefly."
    assert response.usage.input_tokens == chat.usage.prompt_tokens


async def test_a_function_call_round_trip(served):
    client = served
    question = [{"role": "user", "content": QUESTION}]
    chat = await client.chat.completions.create(model=MODEL, messages=question, tools=CHAT_TOOLS, seed=3,
                                                tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    response = await client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, extra_body={"seed": 3},
                                             tool_choice="required", parallel_tool_calls=False, max_output_tokens=80)
    assert response.status == "completed" and response.output_text == ""
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [(t.function.name, t.function.arguments)
                                                      for t in chat.choices[0].message.tool_calls]
    call = calls[0]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), {t["name"]: t["parameters"] for t in TOOLS}[call.name])
    assert [t.name for t in response.tools] == ["get_weather", "add"] and response.tool_choice == "required"

    # streamed: the call's argument deltas join into its arguments
    events = await _events(await client.responses.create(
        model=MODEL, input=QUESTION, tools=TOOLS, extra_body={"seed": 3}, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=80, stream=True))
    _check_sequence(events)
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == call.name
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments and done.item_id == added.item.id
    assert [(i.name, i.arguments) for i in events[-1].response.output] == [(call.name, call.arguments)]

    # the call and its output go back as input items: the chat endpoint's assistant tool call and tool message
    follow_up = [*question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": "12 degrees"}]
    chat = await client.chat.completions.create(model=MODEL, messages=follow_up, tools=CHAT_TOOLS, tool_choice="none",
                                                temperature=0, max_tokens=6)
    items = [*question, *(item.model_dump(exclude_none=True) for item in response.output),
             {"type": "function_call_output", "call_id": call.call_id, "output": "12 degrees"}]
    answer = await client.responses.create(model=MODEL, input=items, tools=TOOLS, tool_choice="none", temperature=0,
                                           max_output_tokens=6)
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


class Forecast(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    rain: bool


async def test_text_format_json_schema_validates(served):
    client = served
    for seed, name in enumerate(SCHEMAS):
        response = await client.responses.create(
            model=MODEL, input=QUESTION, max_output_tokens=160, extra_body={"seed": seed},
            text={"format": {"type": "json_schema", "name": name, "schema": SCHEMAS[name], "strict": True}})
        assert response.status == "completed", name
        jsonschema.validate(json.loads(response.output_text), SCHEMAS[name])
        assert response.text.format.type == "json_schema" and response.text.format.name == name
    parsed = await client.responses.parse(model=MODEL, input=QUESTION, max_output_tokens=160, text_format=Forecast,
                                          extra_body={"seed": 1})
    assert isinstance(parsed.output_parsed, Forecast)
    response = await client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=200, extra_body={"seed": 2},
                                             text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(response.output_text), dict)


@pytest.fixture
async def fake(cluster, make_router):
    await cluster.add_site("fra", 50.1, 8.7)
    key = await cluster.create_key()
    _router, url = await make_router()
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        yield client, url, key


@pytest.mark.parametrize("body, param, says", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "`web_search`"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type", "`file_search`"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type", "`web_search_preview`"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name", "flat"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "keeps no responses"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0]", "text only"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{x"}]}, "input[0].arguments",
     "not valid JSON"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format.schema",
     "cannot be enforced"),
    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens", "context length"),
    ({"truncation": "auto"}, "truncation", "never cut"),
    ({"background": True}, "background", "false"),
    ({"response_format": {"type": "json_object"}}, "response_format", "`text.format`"),
    ({"frobnicate": 1}, "frobnicate", "not supported"),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"include": ["file_search_call.results"]}, "include", "cannot return"),
])
async def test_bad_input_is_a_400_naming_the_responses_field(fake, body, param, says):
    client, _url, _key = fake
    fields = {name: value for name, value in body.items() if name != "input"}
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model=FAKE, input=body.get("input", "hi"), extra_body=fields)
    error = caught.value.body
    assert error["param"] == param and says in error["message"], error


async def test_nothing_is_stored_and_fields_without_effect_are_accepted(fake):
    client, url, key = fake
    response = await client.responses.create(model=FAKE, input="hi", max_output_tokens=4, store=True,
                                             metadata={"team": "edge"}, user="u1", reasoning={"effort": "low"},
                                             truncation="disabled", include=["reasoning.encrypted_content"])
    assert response.metadata == {"team": "edge"} and response.store is False
    with pytest.raises(openai.NotFoundError) as caught:
        await client.responses.retrieve(response.id)
    assert "keeps no responses" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(response.id)
    async with httpx.AsyncClient() as http:
        unauthenticated = await http.get(f"{url}/v1/responses/{response.id}")
    assert unauthenticated.status_code == 401


async def test_logprobs_come_with_the_text(fake):
    client, _url, _key = fake
    response = await client.responses.create(model=FAKE, input="hi", max_output_tokens=5, top_logprobs=1,
                                             include=["message.output_text.logprobs"])
    part = response.output[0].content[0]
    assert len(part.logprobs) == 5 and "".join(entry.token for entry in part.logprobs) == part.text
    events = await _events(await client.responses.create(model=FAKE, input="hi", max_output_tokens=5, top_logprobs=1,
                                                         include=["message.output_text.logprobs"], stream=True))
    assert sum(len(e.logprobs) for e in events if e.type == "response.output_text.delta") == 5


USER = "Weather in Oslo?"


async def test_reasoning_is_an_output_item_and_survives_a_resume(cluster, make_router, tmp_path):
    info, hf = _checkpoint(tmp_path / "qwen3", "Qwen-Qwen3-0.6B")
    think, end_think = hf.convert_tokens_to_ids("<think>"), hf.convert_tokens_to_ids("</think>")
    thought, answer = _ids(hf, "\nThe snow in Oslo is cold today.\n"), _ids(hf, "\n\nSnow, 3 degrees.")
    agents, client = await _client(cluster, make_router, info, [think, *thought, end_think, *answer], num_sites=2)
    async with client:
        response = await client.responses.create(model=FAKE, input=USER, max_output_tokens=64)
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == "The snow in Oslo is cold today.\n"
        assert response.output_text == "Snow, 3 degrees." and response.status == "completed"
        assert response.usage.output_tokens_details.reasoning_tokens == len(thought) + 2
        # A reasoning item replayed before the calls it led to reaches that assistant turn as its reasoning
        # (Qwen3's template writes it back for the turns after the last user message).
        call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": json.dumps({"city": "Oslo"})}
        items = [{"role": "user", "content": USER}, call, {"type": "function_call_output", "call_id": "call_1",
                                                          "output": "3 degrees"}]
        prompts = []
        for replayed in (items, [*items[:1], response.output[0].model_dump(exclude_none=True), *items[1:]]):
            await client.responses.create(model=FAKE, input=replayed, max_output_tokens=64)
            method, request = next(call for agent in agents for call in reversed(agent.calls))
            prompts.append(hf.decode(list(request.prompt_ids)))
        assert "The snow in Oslo" not in prompts[0] and "<think>\nThe snow in Oslo is cold today." in prompts[1]
        assert prompts[1].index("The snow") < prompts[1].index("<tool_call>") < prompts[1].index("3 degrees")

        # The first site dies in the middle of the reasoning; the stream resumes on the other one.
        for agent in agents:
            agent.die_after = 3
        agents[1].die_after = None
        events = await _events(await client.responses.create(model=FAKE, input=USER, max_output_tokens=64,
                                                             stream=True))
        _check_sequence(events)
        reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert (reasoning, text) == (response.output[0].content[0].text, response.output_text)
        assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
        assert any(method == "Decode" and list(request.generated_ids) for method, request in agents[1].calls)

        # Every site dies mid-stream: the stream ends with response.failed, its output so far kept.
        agents[1].die_after = 2
        events = await _events(await client.responses.create(model=FAKE, input=USER, max_output_tokens=64,
                                                             stream=True))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
        assert "could not be resumed" in events[-1].response.error.message
        assert events[-1].response.output[0].type == "reasoning"
