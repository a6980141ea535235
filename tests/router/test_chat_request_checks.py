"""What /v1/chat/completions (and /v1/responses, which becomes a chat request) refuses as OpenAI does, and the
reasoning efforts it takes as OpenAI does, through the official `openai` client: tool names OpenAI refuses or
repeats, tool results without their call and calls without their results are 400s naming the field; the six
`reasoning_effort` values reach each template family as it can honour them (the prompt is transformers'
rendering of the mapped effort), and "none" on a model that always reasons is a 400 saying so."""

from __future__ import annotations

import openai
import pytest
from router_fake_agent import MODEL

from tests.router.test_router_chat import TOOLS, _checkpoint, _prompt_ids, _serve

USER = {"role": "user", "content": "Weather in Oslo and Lisbon?"}


def _call(call_id: str, city: str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}


def _result(call_id: str, text: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _calling(*calls: dict) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


async def _refused(create, **body) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        await create(model=MODEL, max_tokens=2, **body)
    assert caught.value.status_code == 400
    return caught.value


@pytest.mark.parametrize("names, param, words", [
    (["get weather"], "tools[0].function.name", "1-64 letters, digits, underscores or dashes"),
    (["weather.get"], "tools[0].function.name", "1-64 letters, digits, underscores or dashes"),
    (["x" * 65], "tools[0].function.name", "1-64 letters"),
    ([""], "tools[0].function.name", "1-64 letters"),
    (["lookup", "get_weather", "lookup"], "tools[2].function.name", "repeats `lookup`"),
])
async def test_tool_names_openai_refuses_are_400s_naming_the_name(client, names, param, words):
    error = await _refused(client.chat.completions.create, messages=[USER], tools=[_tool(n) for n in names])
    assert error.param == param and words in error.message


async def test_a_responses_tool_name_follows_the_same_rule(client):
    for tools, param, words in (([{"type": "function", "name": "get weather"}], "tools[0].name", "1-64 letters"),
                                ([{"type": "function", "name": "f"}] * 2, "tools[1].name", "repeats `f`")):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model=MODEL, input="hi", tools=tools)
        assert caught.value.param == param and words in caught.value.message


@pytest.mark.parametrize("messages, param, words", [
    # a result with no call before it
    ([USER, _result("call_1", "3")], "messages[1]", "must be a response to a preceding message with 'tool_calls'"),
    # a result naming a call the calling turn did not make
    ([USER, _calling(_call("call_1", "Oslo")), _result("call_9", "3")], "messages[2]", "`call_9`"),
    # a result after the user spoke again: its call's turn is over
    ([USER, _calling(_call("call_1", "Oslo")), _result("call_1", "3"), {"role": "user", "content": "And?"},
      _result("call_1", "3")], "messages[4]", "must be a response to a preceding message with 'tool_calls'"),
    # one of two calls answered before the next user turn
    ([USER, _calling(_call("call_1", "Oslo"), _call("call_2", "Lisbon")), _result("call_2", "20"),
      {"role": "user", "content": "And?"}], "messages[1]", "`call_1`"),
    # a call answered by nothing before the next assistant turn
    ([USER, _calling(_call("call_1", "Oslo")), {"role": "assistant", "content": "Snow."}], "messages[1]",
     "must be followed by tool messages responding to each 'tool_call_id'"),
    # a call answered by nothing at all
    ([USER, _calling(_call("call_1", "Oslo"))], "messages[1]", "before the conversation ends"),
    # a result that names no call; a call without an id; two calls of one id
    ([USER, _calling(_call("call_1", "Oslo")), {"role": "tool", "content": "3"}], "messages[2].tool_call_id",
     "is required"),
    ([USER, _calling({"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}),
      _result("call_1", "3")], "messages[1].tool_calls[0].id", "is required"),
    ([USER, _calling(_call("call_1", "Oslo"), _call("call_1", "Lisbon")), _result("call_1", "3")],
     "messages[1].tool_calls[1].id", "repeats `call_1`"),
])
async def test_unpaired_tool_calls_and_results_are_400s_naming_the_message(client, messages, param, words):
    error = await _refused(client.chat.completions.create, messages=messages, tools=TOOLS)
    assert error.param == param, error.message
    assert words in error.message


async def test_answered_calls_in_any_order_over_several_turns_pass(client):
    """Two calling turns (one call, then two parallel calls answered in reverse order, a system note between)
    and the final answer: a conversation OpenAI takes."""
    messages = [
        USER, _calling(_call("call_1", "Oslo")), _result("call_1", "3°C"),
        {"role": "assistant", "content": "Let me check Lisbon twice.", "tool_calls": [
            _call("call_2", "Lisbon"), _call("call_3", "Lisboa")]},
        _result("call_3", "21°C"), {"role": "system", "content": "Answer in Celsius."}, _result("call_2", "20°C"),
        {"role": "assistant", "content": "Oslo 3°C, Lisbon 20°C."}, {"role": "user", "content": "Thanks!"},
    ]
    answer = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=2)
    assert answer.choices[0].finish_reason in ("length", "stop")


async def test_a_responses_output_after_other_items_reaches_the_model_right_after_its_call(cluster, make_router,
                                                                                           tmp_path):
    """OpenAI's Responses pairs a call and its output by `call_id` wherever the output comes after it; the
    chat conversation it becomes has the result right after the call, as transformers renders it."""
    info, hf = _checkpoint(tmp_path / "qwen3", "Qwen-Qwen3-0.6B")
    agent, url, headers = await _serve(cluster, make_router, info)
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    later = {"role": "user", "content": "Quickly, please."}
    items = [USER, call, later, {"type": "function_call_output", "call_id": "call_1", "output": "3°C"}]
    key = headers["Authorization"].removeprefix("Bearer ")
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        await client.responses.create(model=MODEL, input=items, max_output_tokens=2,
                                      tools=[{"type": "function", **TOOLS[0]["function"]}])
    calling = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    expected = hf.apply_chat_template([USER, calling, _result("call_1", "3°C"), later], add_generation_prompt=True,
                                      tools=[{"type": "function", "function": {**TOOLS[0]["function"],
                                                                               "strict": True}}],
                                      return_dict=False)
    assert _prompt_ids(agent) == list(expected)


async def _served_client(cluster, make_router, tmp_path, template: str):
    info, hf = _checkpoint(tmp_path / "model", template)
    agent, url, headers = await _serve(cluster, make_router, info)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=headers["Authorization"].removeprefix("Bearer "),
                                max_retries=0)
    return client, agent, hf


# (template, effort sent, the template kwargs transformers renders the same prompt with)
EFFORTS = [
    ("openai-gpt-oss-120b", "minimal", {"reasoning_effort": "low"}),     # harmony's lowest level
    ("openai-gpt-oss-120b", "medium", {"reasoning_effort": "medium"}),
    ("openai-gpt-oss-120b", "xhigh", {"reasoning_effort": "high"}),      # harmony's highest level
    ("Qwen-Qwen3-0.6B", "none", {"enable_thinking": False}),
    ("Qwen-Qwen3-0.6B", "xhigh", {}),
    ("HuggingFaceTB-SmolLM3-3B", "none", {"enable_thinking": False}),
    ("deepseek-ai-DeepSeek-V3.1", "low", {"thinking": True}),            # off unless asked: an effort asks
    ("deepseek-ai-DeepSeek-V3.1", "none", {}),
    ("meta-llama-Llama-3.1-8B-Instruct", "none", {}),                    # a model that does not reason
]


@pytest.mark.parametrize("template, effort, as_transformers", EFFORTS)
async def test_each_effort_reaches_the_template_as_it_can_honour_it(cluster, make_router, tmp_path, template, effort,
                                                                    as_transformers):
    client, agent, hf = await _served_client(cluster, make_router, tmp_path, template)
    async with client:
        await client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=1, reasoning_effort=effort)
    expected = hf.apply_chat_template([USER], add_generation_prompt=True, return_dict=False, **as_transformers)
    assert _prompt_ids(agent) == list(expected)


@pytest.mark.parametrize("template", ["openai-gpt-oss-120b", "Kimi-K2-Thinking"])
async def test_none_on_a_model_that_always_reasons_is_a_400_saying_so(cluster, make_router, tmp_path, template):
    client, agent, _hf = await _served_client(cluster, make_router, tmp_path, template)
    async with client:
        error = await _refused(client.chat.completions.create, messages=[USER], reasoning_effort="none")
        assert error.param == "reasoning_effort" and "always reasons" in error.message
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model=MODEL, input="hi", reasoning={"effort": "none"})
        assert caught.value.param == "reasoning.effort" and "always reasons" in caught.value.message
    assert not [method for method, _request in agent.calls if method != "GetModelInfo"]


async def test_efforts_through_responses_and_the_ones_refused(cluster, make_router, tmp_path):
    client, agent, hf = await _served_client(cluster, make_router, tmp_path, "Qwen-Qwen3-0.6B")
    async with client:
        await client.responses.create(model=MODEL, input=[USER], max_output_tokens=1, reasoning={"effort": "none"})
        assert _prompt_ids(agent) == list(hf.apply_chat_template([USER], add_generation_prompt=True,
                                                                 return_dict=False, enable_thinking=False))
        error = await _refused(client.chat.completions.create, messages=[USER], reasoning_effort="none",
                               extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert error.param == "reasoning_effort" and error.code == "invalid_parameter_combination"
        error = await _refused(client.chat.completions.create, messages=[USER], reasoning_effort="extreme")
        assert error.param == "reasoning_effort"
        assert "none, minimal, low, medium, high, xhigh" in error.message
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model=MODEL, input="hi", reasoning={"effort": "extreme"})
        assert caught.value.param == "reasoning.effort"
