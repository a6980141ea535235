"""/v1/responses read by the official `openai` client as its own models define a Response and its stream
events: every answer and event validates against the SDK's pydantic models (not only the lenient parsing its
client does), streamed and non-streamed answers agree, and what OpenAI refuses (a function call without its
output, metadata that is not strings, tool fields with no effect here) is a 400 naming the field.

Text runs on fake agents; the function-call round trip on a real engine (the structured tests' in-process
agent with Qwen2.5's template and Hermes tool calls), as an agent framework sends it back.
"""

from __future__ import annotations

import json
import typing

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from router_fake_agent import MODEL as FAKE

from tests.router.test_router_structured import ADD, MODEL, WEATHER, _build, serving

TOOLS = [{"type": "function", **tool["function"], "strict": True} for tool in (WEATHER, ADD)]
# the SDK's event model per event type
EVENT_MODELS = {typing.get_args(model.model_fields["type"].annotation)[0]: model
                for model in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


@pytest.fixture
async def fake(cluster, make_router):
    agent = await cluster.add_site("fra", 50.1, 8.7)
    key = await cluster.create_key()
    _router, url = await make_router()
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        yield client, agent, url, key


async def _post(url: str, key: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(f"{url}/v1/responses", json=body, headers={"authorization": f"Bearer {key}"})


def _validated_events(text: str) -> list:
    """Each server-sent event as the SDK's model of its type, validated (a missing field raises)."""
    events = []
    for frame in text.split("\n\n"):
        if frame.startswith("event: "):
            event = json.loads(frame.split("\ndata: ", 1)[1])
            events.append(EVENT_MODELS[event["type"]].model_validate(event))
    return events


async def test_answers_and_stream_events_validate_against_the_sdk_models(fake):
    _client, agent, url, key = fake
    agent.eos_at = 3
    answer = await _post(url, key, {"model": FAKE, "input": "hi", "metadata": {"team": "edge"}})
    response = Response.model_validate(answer.json())
    assert response.status == "completed" and response.output_text
    usage = response.usage
    assert usage.input_tokens_details.cache_write_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens

    stream = await _post(url, key, {"model": FAKE, "input": "hi", "stream": True})
    events = _validated_events(stream.text)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == response.output_text
    assert events[-1].response.usage == usage


async def test_metadata_is_strings_within_openais_limits(fake):
    client, _agent, _url, _key = fake
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model=FAKE, input="hi", metadata={"team": 7})
    assert caught.value.param == "metadata.team" and "string" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model=FAKE, input="hi", metadata={f"k{i}": "v" for i in range(17)})
    assert caught.value.param == "metadata" and "16" in caught.value.message
    response = await client.responses.create(model=FAKE, input="hi", max_output_tokens=2, metadata={"team": "edge"})
    assert response.metadata == {"team": "edge"}


async def test_an_empty_answer_streams_the_message_the_answer_has(fake):
    client, agent, _url, _key = fake
    agent.eos_at = 0  # the model ends at once
    response = await client.responses.create(model=FAKE, input="hi")
    async with client.responses.stream(model=FAKE, input="hi") as stream:
        types = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert [(item.type, item.status) for item in final.output] == [(item.type, item.status)
                                                                   for item in response.output] == [
        ("message", "completed")]
    assert final.output_text == response.output_text == ""
    assert types[2:-1] == ["response.output_item.added", "response.content_part.added", "response.output_text.done",
                           "response.content_part.done", "response.output_item.done"]


async def test_a_stream_that_fails_marks_the_item_it_cut_incomplete(fake):
    client, agent, _url, _key = fake
    agent.die_after = 2  # the only site dies mid-answer: the stream cannot resume
    async with client.responses.stream(model=FAKE, input="hi", max_output_tokens=6) as stream:
        events = [event async for event in stream]
    assert events[-1].type == "response.failed"
    cut = events[-1].response.output[0]
    assert cut.type == "message" and cut.status == "incomplete" and cut.content[0].text
    assert "response.output_item.done" not in [event.type for event in events]


CALL = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{\"a\": 1, \"b\": 2}",
        "id": "fc_1", "status": "completed"}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "3"}
USER = {"role": "user", "content": "add 1 and 2"}
FLAT_ADD = {"type": "function", "name": "add", "parameters": ADD["function"]["parameters"]}


@pytest.mark.parametrize("body, param, says", [
    ({"input": [USER, OUTPUT]}, "input[1].call_id", "no `function_call` item before it"),
    ({"input": [USER, {**CALL, "call_id": "call_2"}, OUTPUT]}, "input[2].call_id", "`call_1`"),
    ({"input": [USER, CALL, {"role": "user", "content": "and 3?"}]}, "input[1]", "no `function_call_output`"),
    ({"input": [USER, CALL]}, "input[1]", "no `function_call_output`"),
    ({"tools": [{**FLAT_ADD, "name": "add numbers"}]}, "tools[0].name", "letters, digits"),
    ({"tools": [FLAT_ADD, FLAT_ADD]}, "tools[1].name", "repeats `add`"),
    ({"tools": [{**FLAT_ADD, "defer_loading": True}]}, "tools[0].defer_loading", "no tool search"),
    ({"tools": [{**FLAT_ADD, "allowed_callers": ["programmatic"]}]}, "tools[0].allowed_callers", "only the model"),
    ({"tools": [{**FLAT_ADD, "output_schema": {"type": "integer"}}]}, "tools[0].output_schema", "not supported"),
    ({"tools": [FLAT_ADD], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                           "tools": [{"type": "function", "function": {"name": "add"}}]}},
     "tool_choice.tools[0]", "{\"type\": \"function\", \"name\": ...}"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "schema_": {}}}},
     "text.format.schema_", "not supported"),
    ({"text": {"format": {"type": "json_object", "strict": True}}}, "text.format.strict", "not supported"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention", "in memory only"),
])
async def test_what_cannot_be_honoured_is_a_400_naming_the_field(fake, body, param, says):
    client, _agent, _url, _key = fake
    fields = {name: value for name, value in body.items() if name != "input"}
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model=FAKE, input=body.get("input", "hi"), extra_body=fields)
    error = caught.value.body
    assert error["param"] == param and says in error["message"], error


async def test_tool_fields_and_retention_without_effect_are_accepted(fake):
    client, _agent, _url, _key = fake
    response = await client.responses.create(
        model=FAKE, input="hi", max_output_tokens=2, prompt_cache_retention="in_memory",
        tools=[{**FLAT_ADD, "strict": True, "defer_loading": False, "allowed_callers": ["direct"]}])
    assert response.status == "incomplete" and response.tools[0].name == "add"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("qwen-noise"))


async def test_a_streamed_function_call_round_trip_as_an_agent_sends_it(cluster, make_router, qwen_dir):
    """The stream helper's final response, every event valid by the SDK's models; its output items replayed
    as `model_dump(exclude_unset=True)` (ids and statuses included) with the call's output."""
    async with serving(cluster, make_router, qwen_dir, MODEL) as (client, _engine):
        request = dict(model=MODEL, input=[USER], tools=TOOLS, tool_choice={"type": "function", "name": "add"},
                       max_output_tokens=80, extra_body={"seed": 3})
        async with client.responses.stream(**request) as stream:
            streamed = [event async for event in stream]
            final = await stream.get_final_response()
        assert final.status == "completed"
        calls = [item for item in final.output if item.type == "function_call"]
        assert [call.name for call in calls] == ["add"] and json.loads(calls[0].arguments).keys() == {"a", "b"}
        async with httpx.AsyncClient(timeout=60) as http:
            raw = await http.post(f"{client.base_url}responses", headers={"authorization": f"Bearer {client.api_key}"},
                                  json={**{k: v for k, v in request.items() if k != "extra_body"}, "seed": 3,
                                        "stream": True})
        events = _validated_events(raw.text)
        def steps(events: list) -> list[str]:  # the events but the deltas, which split where chunks do
            return [event.type for event in events if not event.type.endswith(".delta")]
        assert steps(events) == steps(streamed)
        assert Response.model_validate(events[-1].response.model_dump()).output[0].arguments == calls[0].arguments

        items = [USER, *(item.model_dump(exclude_unset=True) for item in final.output),
                 *({"type": "function_call_output", "call_id": call.call_id, "output": "3"} for call in calls)]
        assert {"id", "status"} <= items[1].keys()
        answer = await client.responses.create(model=MODEL, input=items, tools=TOOLS, tool_choice="none",
                                               max_output_tokens=4, extra_body={"seed": 1})
        assert [item.type for item in answer.output] == ["message"]
        assert answer.usage.input_tokens_details.cache_write_tokens == 0
