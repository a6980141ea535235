"""`response_format` with tools under `tool_choice: auto` (the OpenAI Agents SDK's agent with an output type
and tools: each turn either calls a tool or gives the final answer as JSON), and reasoning before a
constrained answer for models that open their own reasoning block (Qwen3 writes `<think>` itself).

Grammar level, for every recognised tool-call format: the answer follows the response format's schema,
or the output is calls of the offered tools (strict ones' arguments following their schema); the parser
takes a JSON answer for an answer even where it looks like a call (Llama 3's bare JSON) or holds the
marker's text. Which reasoning block the grammar allows is read from the prompt and the request.
Served, through the official `openai` client: a noise checkpoint with Qwen2.5's template answers schema-
valid JSON or valid calls for every seed; a checkpoint with Qwen3's template crafted to think comes back
with its thought as `reasoning_content` and valid JSON (or a valid call) after it.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from tokenizers import Tokenizer

from engine.grammar import json_schema_spec
from engine.tokenizer import ChatTokenizer
from router.completions import request_grammar
from router.model_assets import ModelAssets
from router.openai_request import parse_request
from router.reasoning import reasoning_format, with_reasoning
from router.tool_calls import FORMATS, ToolCallStream, tool_call_format
from tests.router.test_router_reasoning_model import REASONING, _build_thinker
from tests.router.test_router_structured import MODEL, model_dir, serving  # noqa: F401 (fixture)
from tests.router.test_router_tool_calls import CALL_TEXT, EXPECTED
from tests.router.test_tool_calls_strict_auto import ADD, NOTE, SCHEMA_OF, WEATHER, _accepts, _two_calls

QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]
# The agent's output type; `name` first, as a Llama 3 call's object begins.
REPORT = {"type": "object", "additionalProperties": False, "required": ["name", "sky"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "sky": {"enum": ["sun", "rain", "snow"]}}}
REPORT_FORMAT = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}}
ANSWER = '{"name": "Oslo", "sky": "snow"}'


def _assets(tokenizer: ChatTokenizer, **more) -> ModelAssets:
    return ModelAssets(model=MODEL, tokenizer=tokenizer, context_length=4096, eos_token_ids=[0], block_size=16,
                       kv_bytes_per_token=1, generation_config={}, **more)


@pytest.mark.parametrize("name", sorted(CALL_TEXT))
def test_the_answer_follows_the_response_format_or_the_output_is_calls(name, template_tokenizer):
    tokenizer = template_tokenizer(next(t for t, f in EXPECTED.items() if f == name))
    fmt = FORMATS[name]
    spec = fmt.answer_or_calls_grammar(json_schema_spec(REPORT), [ADD, NOTE], True, tokenizer)
    call = CALL_TEXT[name]
    assert _accepts(tokenizer, spec, ANSWER)
    assert _accepts(tokenizer, spec, call)
    # the answer follows its schema: a missing key, a value outside the enum, words
    assert not _accepts(tokenizer, spec, '{"name": "Oslo"}')
    assert not _accepts(tokenizer, spec, '{"name": "Oslo", "sky": "fog"}')
    assert not _accepts(tokenizer, spec, "It snows in Oslo.")
    # calls: strict arguments follow the schema, only offered functions, the non-strict one takes any object
    assert not _accepts(tokenizer, spec, call.replace('"a": 1', '"a": 100'))
    assert not _accepts(tokenizer, spec, call.replace("add", "sub"))
    assert _accepts(tokenizer, spec, call.replace("add", "note").replace('"a": 1, "b": 2', '"x": [true]'))
    if fmt.marker:  # calls open the output; the marker cannot end an answer or start one without a call
        assert not _accepts(tokenizer, spec, "Let me add. " + call)
        assert not _accepts(tokenizer, spec, ANSWER + call)
        assert not _accepts(tokenizer, spec, fmt.marker + ANSWER)
    if fmt.parallel:
        assert _accepts(tokenizer, spec, _two_calls(fmt, call))
        assert not _accepts(tokenizer, fmt.answer_or_calls_grammar(json_schema_spec(REPORT), [ADD], False, tokenizer),
                            _two_calls(fmt, call))
    # json_object: any object answers
    any_object = fmt.answer_or_calls_grammar(json_schema_spec({"type": "object"}), [ADD], True, tokenizer)
    assert _accepts(tokenizer, any_object, '{"anything": [1, 2]}') and _accepts(tokenizer, any_object, call)


def _split(fmt, text: str, names=frozenset({"add", "note"}), step: int = 3) -> tuple[str, list]:
    """(content, calls) of an answer streamed `step` characters at a time, as the router splits it."""
    stream, content = ToolCallStream(fmt, names=names, answer_or_calls=True), ""
    for i in range(0, len(text), step):
        content += stream.add(text[i:i + step])
    tail, calls = stream.finish()
    return content + tail, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name", sorted(CALL_TEXT))
def test_the_parser_takes_a_json_answer_for_the_answer(name):
    fmt = FORMATS[name]
    assert _split(fmt, CALL_TEXT[name]) == ("", [("add", {"a": 1, "b": 2})])
    assert _split(fmt, ANSWER) == (ANSWER, [])
    # an answer whose strings hold the marker, even with a call's text after it, stays the answer
    text = json.dumps({"name": f"{fmt.marker}add", "sky": CALL_TEXT[name]})
    assert _split(fmt, text) == (text, [])


def test_a_bare_json_call_is_told_from_an_answer_by_its_shape_and_name():
    """Llama 3 writes a call as an object with `name`; an answer may have one too."""
    fmt = FORMATS["llama3_json"]
    assert _split(fmt, '{"name": "Oslo", "sky": "snow"}') == ('{"name": "Oslo", "sky": "snow"}', [])
    assert _split(fmt, '{"name": "add"}') == ("", [("add", {})])
    assert _split(fmt, '{"name": "add", "sky": "rain"}') == ('{"name": "add", "sky": "rain"}', [])
    # a stream given no function names (none are known) reads any object with a name as a call; the router
    # always gives the request's, so there such an object is an answer (test_tool_calls_edges)
    plain = ToolCallStream(fmt)
    plain.add('{"name": "Oslo", "sky": "snow"}')
    assert [c.name for c in plain.finish()[1]] == ["Oslo"]


def test_the_prompt_and_the_request_decide_whether_the_model_may_think(template_tokenizer):
    qwen3 = template_tokenizer("Qwen-Qwen3-0.6B")
    reasoning = reasoning_format(qwen3)
    answer = json_schema_spec(REPORT)
    thought = "<think>\nThey want a report.\n</think>\n\n"

    def grammar(**kwargs):
        return with_reasoning(answer, reasoning, qwen3.encode_chat(QUESTION, **kwargs), qwen3, kwargs)

    free = grammar()
    assert _accepts(qwen3, free, thought + ANSWER) and _accepts(qwen3, free, ANSWER)
    assert not _accepts(qwen3, free, thought + "It snows.")
    assert not _accepts(qwen3, free, "<think>\nno end" + ANSWER)
    # thinking switched off: the template closes an empty block in the prompt; the request says so
    for off in (grammar(enable_thinking=False), with_reasoning(answer, reasoning, qwen3.encode_chat(QUESTION), qwen3,
                                                                {"enable_thinking": False})):
        assert _accepts(qwen3, off, ANSWER) and not _accepts(qwen3, off, thought + ANSWER)
    # a prompt that opens the block (DeepSeek-V3.1 with thinking): the model is inside it and must close it
    v31 = template_tokenizer("deepseek-ai-DeepSeek-V3.1")
    opened = with_reasoning(answer, reasoning_format(v31), v31.encode_chat(QUESTION, thinking=True), v31,
                            {"thinking": True})
    assert _accepts(v31, opened, "They want a report.</think>" + ANSWER)
    assert not _accepts(v31, opened, ANSWER)


def test_request_grammar_is_the_answer_or_calls_only_with_both_under_auto(template_tokenizer):
    tokenizer = template_tokenizer("Qwen-Qwen2.5-7B-Instruct")
    assets = _assets(tokenizer, tool_calls=tool_call_format(tokenizer))

    def grammar(assets=assets, **body):
        return request_grammar(parse_request({"model": MODEL, "messages": QUESTION, **body}, chat=True), assets)

    both = grammar(response_format=REPORT_FORMAT, tools=[WEATHER, NOTE])
    assert _accepts(tokenizer, both, ANSWER) and _accepts(tokenizer, both, CALL_TEXT["hermes"].replace("add", "note"))
    # without tools, with tools turned off, or on a model without a known format: the response format alone
    alone = grammar(response_format=REPORT_FORMAT)
    assert alone == json_schema_spec(REPORT)
    assert grammar(response_format=REPORT_FORMAT, tools=[WEATHER], tool_choice="none") == alone
    assert grammar(_assets(tokenizer), response_format=REPORT_FORMAT, tools=[WEATHER]) == alone
    # without a response format: as before (no grammar unless a tool is strict)
    assert grammar(tools=[NOTE]) is None


async def test_agents_get_a_valid_answer_or_valid_calls(cluster, make_router, model_dir):  # noqa: F811
    """Noise sampled at temperature 1, the first token nudged (logit_bias on `{`) so that the answer and a call are
    about as likely: every answer validates against the output type, every call against its function."""
    async with serving(cluster, make_router, model_dir, MODEL) as (client, engine):
        vocab = Tokenizer.from_file(str(engine.model_dir / "tokenizer.json"))
        # the end of the turn nudged too, where parallel calls may go on
        nudge = {str(vocab.token_to_id("{")): 9, str(vocab.token_to_id("<|im_end|>")): 8}

        async def answer(seed: int, parallel: bool = False, **fields):
            return await client.chat.completions.create(
                model=MODEL, messages=QUESTION, tools=[WEATHER, ADD], seed=seed, temperature=1.0, max_tokens=160,
                parallel_tool_calls=parallel, logit_bias=nudge, response_format=REPORT_FORMAT, **fields)

        single = await asyncio.gather(*(answer(seed) for seed in range(16)))
        kinds = [_check(completion.choices[0], parallel=False) for completion in single]
        assert kinds.count("call") >= 3 and kinds.count("answer") >= 3, kinds
        several = await asyncio.gather(*(answer(seed, True) for seed in range(16, 24)))
        assert "call" in [_check(completion.choices[0], parallel=True) for completion in several]
        # streamed, a call and an answer say what their responses say
        seeds = [kinds.index("call"), kinds.index("answer")]
        streamed = [[chunk async for chunk in await answer(seed, stream=True)] for seed in seeds]
    for chunks, seed in zip(streamed, seeds):
        message = single[seed].choices[0].message
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (message.content or "")
        calls: dict[int, list[str]] = {}
        for delta in (c.choices[0].delta for c in chunks if c.choices):
            for part in delta.tool_calls or ():
                name, arguments = calls.setdefault(part.index, ["", ""])
                calls[part.index] = [name + (part.function.name or ""), arguments + (part.function.arguments or "")]
        assert [tuple(c) for c in calls.values()] == [(t.function.name, t.function.arguments)
                                                      for t in message.tool_calls or ()]


def _check(choice, parallel: bool) -> str:
    """"call" or "answer", after checking it: calls validate against their function, an answer against the
    output type; "cut" for an output max_tokens ended (the nudged model strings parallel calls together): the
    calls it completed validate, the last comes as far as it got, and no call's markup is left as content."""
    if choice.finish_reason == "length":
        assert parallel, choice
        for call in (choice.message.tool_calls or [])[:-1]:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
        assert "<tool_call>" not in (choice.message.content or "")
        return "cut"
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert parallel or len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
        return "call"
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), REPORT)
        return "answer"
    raise AssertionError(f"unexpected finish: {choice}")


@pytest.fixture(scope="module")
def thinker_dir(tmp_path_factory):
    return _build_thinker(tmp_path_factory.mktemp("thinker"))


async def test_a_model_that_opens_its_own_reasoning_thinks_before_its_json(cluster, make_router, thinker_dir):
    """The checkpoint writes `<think>` Snow in Oslo `</think>` by itself; under a response format (or a required
    call) it still thinks, and the JSON after the thought is the answer."""
    thinker = "thinker"
    async with serving(cluster, make_router, thinker_dir, thinker) as (client, _engine):
        async def ask(seed: int, **fields):
            return await client.chat.completions.create(model=thinker, messages=QUESTION, seed=seed, max_tokens=96,
                                                        **fields)

        answers = await asyncio.gather(*(ask(seed, response_format=REPORT_FORMAT) for seed in range(4)))
        stream = await client.chat.completions.create(model=thinker, messages=QUESTION, seed=0, max_tokens=96,
                                                      response_format=REPORT_FORMAT, stream=True)
        chunks = [chunk async for chunk in stream]
        called = await ask(0, tools=[WEATHER], tool_choice="required")
        agent = await ask(0, tools=[WEATHER], response_format=REPORT_FORMAT)
        switched_off = await ask(0, response_format=REPORT_FORMAT,
                                 extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    for completion in answers:
        message = completion.choices[0].message
        assert message.model_extra["reasoning_content"] == REASONING
        assert message.content.startswith("{")  # the blank after the thought is neither reasoning nor answer
        jsonschema.validate(json.loads(message.content), REPORT)
        assert completion.usage.completion_tokens_details.reasoning_tokens > 0
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == answers[0].choices[0].message.content
    call = called.choices[0].message
    assert call.model_extra["reasoning_content"] == REASONING and called.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.tool_calls[0].function.arguments), SCHEMA_OF["get_weather"])
    message = agent.choices[0].message
    assert message.model_extra["reasoning_content"] == REASONING
    if message.tool_calls:
        jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), SCHEMA_OF["get_weather"])
    else:
        jsonschema.validate(json.loads(message.content), REPORT)
    # thinking switched off: the template closed an empty block, and the model may not open another
    assert not switched_off.choices[0].message.model_extra.get("reasoning_content")
    jsonschema.validate(json.loads(switched_off.choices[0].message.content), REPORT)
