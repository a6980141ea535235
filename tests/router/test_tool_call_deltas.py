"""Tool calls streamed as they are written, as OpenAI streams them: a call opens with its index, id, type and
name, its arguments follow in pieces as the model writes them, and the finish chunk comes last. The pieces
join into exactly the calls the whole (non-streamed) answer returns, for every format, under a required
call and under `auto`, cut by max_tokens, resumed on another site mid-arguments, and per choice with n > 1.

At the parser, every end point of every format's text, read a few characters at a time; through the router,
the official `openai` client (raw chunks and its stream helper's accumulator) against a fake agent scripted
to write a chosen text (tests/router/test_tool_calls_edges.py's `scripted`).
"""

from __future__ import annotations

import json

import pytest
from router_fake_agent import MODEL

from router.tool_calls import FORMATS, ToolCallStream
from tests.router.test_router_tool_calls import CALL_TEXT
from tests.router.test_tool_calls_edges import scripted
from tests.router.test_tool_calls_strict_auto import _two_calls

NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}, "tags": {"type": "array"}}, "required": ["text"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = [NOTE, ADD]
NAMES = frozenset({"note", "add"})
# Long arguments, with the JSON a model writes: escapes, a nested array, numbers and literals, unusual spacing.
LONG_ARGS = ('{"text":  "Dear team, the quarterly \\"numbers\\" are in: revenue rose\\nand costs fell. '
             + "Thanks to everyone who helped. " * 6 + '", "tags": [1.5e3, -2, true, null, "caf\\u00e9"]}')
MESSAGES = [{"role": "user", "content": "Write a note, then add 1 and 2."}]


def calls_text(name: str) -> str:
    """The format's text of a long `note` call, then (where the format holds several) an `add` call."""
    fmt, one = FORMATS[name], CALL_TEXT[name]
    note = one.replace("add", "note").replace('{"a": 1, "b": 2}', LONG_ARGS)
    if not fmt.parallel:
        return note
    two = _two_calls(fmt, one)
    return two.replace("add", "note", 1).replace('{"a": 1, "b": 2}', LONG_ARGS, 1)


def expected_calls(name: str) -> list[tuple[str, str]]:
    assert json.loads(LONG_ARGS)["tags"][-1] == "café"
    return [("note", LONG_ARGS)] + ([("add", '{"a": 1, "b": 2}')] if FORMATS[name].parallel else [])


def stream_through(stream: ToolCallStream, text: str, step: int, cut: bool = False):
    """(content, deltas per add, the final deltas, calls) of `text` read `step` characters at a time."""
    content, during = "", []
    for i in range(0, len(text), step):
        content += stream.add(text[i:i + step])
        during.append(stream.take_deltas())
    tail, calls = stream.finish(cut)
    return content + tail, during, stream.take_deltas(), calls


def join(deltas: list[dict]) -> list[dict]:
    """The calls a client builds from deltas, checking OpenAI's shape: an id, type and name once, then arguments."""
    calls: list[dict] = []
    for delta in deltas:
        part, = delta["tool_calls"]
        if "id" in part:
            assert part["index"] == len(calls) and part["type"] == "function", part
            assert part["function"]["arguments"] == "" and part["function"]["name"], part
            calls.append({"id": part["id"], "name": part["function"]["name"], "arguments": ""})
        else:
            assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}, part
            calls[part["index"]]["arguments"] += part["function"]["arguments"]
    return calls


def as_dicts(calls) -> list[dict]:
    return [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]


# -- the parser ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CALL_TEXT))
@pytest.mark.parametrize("forced", [True, False], ids=["required", "auto"])
def test_calls_stream_as_written_and_join_into_the_final_calls(name, forced):
    fmt = FORMATS[name]
    words = "" if forced or not fmt.marker else "Let me write that down. "
    text = words + calls_text(name)
    content, during, last, calls = stream_through(ToolCallStream(fmt, forced, names=NAMES), text, 3)
    assert content == words
    assert [(c.name, c.arguments) for c in calls] == expected_calls(name)
    assert join([d for ds in during for d in ds] + last) == as_dicts(calls)
    if forced or fmt.marker:  # the long arguments came in many pieces before the answer ended
        assert sum(1 for ds in during for d in ds if d["tool_calls"][0]["function"]["arguments"]) > 10
        assert [d["tool_calls"][0]["function"]["name"] for ds in during for d in ds if "id" in d["tool_calls"][0]] \
            == [n for n, _ in expected_calls(name)]
    else:  # Llama 3's bare JSON under auto is a call only once its object is whole: it comes when the object closes
        assert not any(during[:-1]) and len(during[-1]) == 2 and last == []


@pytest.mark.parametrize("name", sorted(CALL_TEXT))
@pytest.mark.parametrize("forced", [True, False], ids=["required", "auto"])
def test_at_every_end_the_streamed_calls_are_the_final_ones(name, forced):
    """The answer ends after every character, cut by max_tokens or stopped (an end of sequence inside a call):
    the deltas always join into the calls `finish` returns, and what streamed is never taken back."""
    fmt = FORMATS[name]
    text = calls_text(name)
    for end in range(0, len(text) + 1, 2):
        for cut in (True, False):
            stream = ToolCallStream(fmt, forced, names=NAMES)
            content, during, last, calls = stream_through(stream, text[:end], 5, cut)
            streamed = join([d for ds in during for d in ds])
            assert join([d for ds in during for d in ds] + last) == as_dicts(calls), (end, cut)
            assert len(calls) >= len(streamed), (end, cut)
            if calls and cut:
                assert content == "", (end, content)


def test_a_call_that_breaks_after_it_opened_keeps_what_was_sent():
    """Under auto a free model may break its markup after a call opened: the call stays (a client was shown it),
    with the arguments sent, as far as they were JSON; the broken markup is no content. An answer that ends
    inside its calls reads as one cut there."""
    fmt = FORMATS["hermes"]
    for text, arguments in (
            ('Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": oops}}\n</tool_call>', '{"a": 1, "b": '),
            ('Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_cal>', '{"a": 1, "b": 2}'),
            ('Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1', '{"a": 1'),
            ('Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool', '{"a": 1, "b": 2}')):
        content, during, last, calls = stream_through(ToolCallStream(fmt, names=NAMES), text, 4)
        assert content == "Sure. " and [(c.name, c.arguments) for c in calls] == [("add", arguments)], text
        assert join([d for ds in during for d in ds] + last) == as_dicts(calls)
    # after a whole call, words and a second call that breaks once it opened: both stay calls (the second as far
    # as its arguments were JSON), the words are content and the broken markup is not
    whole = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    rest = 'then <tool_call>\n{"name": "add", "arguments": {"a": 3,}}\n</tool_call>'
    stream = ToolCallStream(fmt, names=NAMES)
    content, during, last, calls = stream_through(stream, whole + "\n" + rest, 4)
    assert [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1, "b": 2}'), ("add", '{"a": 3,')]
    assert content == "then " and stream.dropped == []
    assert join([d for ds in during for d in ds] + last) == as_dicts(calls)


def test_members_around_the_name_and_arguments_do_not_stop_the_streaming():
    """Command R7B's template writes a `tool_call_id` before the name; a free model may add members after the
    arguments. The call still streams as written, and the final call is the same."""
    fmt = FORMATS["command_r7b"]
    text = ('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "note", "parameters": ' + LONG_ARGS
            + ', "note": {"x": [1]}}, {"tool_call_id": "1", "tool_name": "add", "parameters": {"a": 1, "b": 2}}]'
            '<|END_ACTION|>')
    content, during, last, calls = stream_through(ToolCallStream(fmt, names=NAMES), text, 3)
    assert content == "" and [(c.name, c.arguments) for c in calls] == expected_calls("command_r7b")
    assert sum(1 for ds in during for d in ds if d["tool_calls"][0]["function"]["arguments"]) > 10
    assert not last and join([d for ds in during for d in ds]) == as_dicts(calls)


def test_a_call_of_no_offered_function_is_no_call():
    """Under auto a call must name an offered function (a client cannot run another): the answer that names
    another is content, as it was written, and nothing of it streams as a call."""
    fmt = FORMATS["hermes"]
    text = 'Hm. <tool_call>\n{"name": "delete_all", "arguments": {"really": true}}\n</tool_call>'
    for answer in (text, text[:-5]):
        content, during, last, calls = stream_through(ToolCallStream(fmt, names=NAMES), answer, 4)
        assert not any(during) and not last and not calls and content == answer


# -- through the router ----------------------------------------------------------------------------------


async def read_chunks(client, **body) -> list:
    return [chunk async for chunk in await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True, **body)]


def streamed_calls(chunks, choice_index: int = 0) -> tuple[list[dict], int, str | None]:
    """(the calls joined from one choice's deltas, how many chunks carried arguments before its finish chunk,
    its finish reason)."""
    deltas, num_argument_chunks, finish = [], 0, None
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.index != choice_index:
                continue
            for part in choice.delta.tool_calls or ():
                assert finish is None, "a call delta after the finish chunk"
                deltas.append({"tool_calls": [part.model_dump(exclude_none=True)]})
            num_argument_chunks += any(p.function.arguments for p in choice.delta.tool_calls or ())
            finish = choice.finish_reason or finish
    return join(deltas), num_argument_chunks, finish


def message_calls(message) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or ()]


def without_ids(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["name"], c["arguments"]) for c in calls]


@pytest.mark.parametrize("name", sorted(CALL_TEXT))
async def test_each_format_streams_its_calls_before_the_finish_chunk(cluster, make_router, name):
    async with scripted(cluster, make_router, name) as (client, script, _tokenizer):
        for tool_choice, words in (("required", ""), ("auto", "Noted. " if FORMATS[name].marker else "")):
            script(words + calls_text(name))
            whole = (await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                                          tool_choice=tool_choice)).choices[0]
            chunks = await read_chunks(client, tool_choice=tool_choice)
            calls, num_argument_chunks, finish = streamed_calls(chunks)
            assert without_ids(calls) == without_ids(message_calls(whole.message)) == expected_calls(name)
            assert finish == whole.finish_reason == "tool_calls"
            assert len({c["id"] for c in calls}) == len(calls) and all(c["id"].startswith("call_") or
                                                                       FORMATS[name].short_ids for c in calls)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == words
            if tool_choice == "required" or FORMATS[name].marker:
                assert num_argument_chunks > 10, num_argument_chunks
            # the SDK's stream helper accumulates the same message
            async with client.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                                      tool_choice=tool_choice) as helper:
                events = [event.type async for event in helper]
                final = (await helper.get_final_completion()).choices[0]
            assert without_ids(message_calls(final.message)) == expected_calls(name)
            assert (final.message.content or "") == (whole.message.content or "") == words
            assert events.count("tool_calls.function.arguments.delta") > (10 if num_argument_chunks > 10 else 0)


@pytest.mark.parametrize("name", ["hermes", "mistral", "kimi_k2", "llama3_json"])
async def test_a_call_cut_by_max_tokens_streams_what_the_whole_answer_returns(cluster, make_router, name):
    async with scripted(cluster, make_router, name) as (client, script, tokenizer):
        ids = script(calls_text(name))
        text = calls_text(name)
        middle = text.index("revenue")
        max_tokens = next(k for k in range(len(ids)) if len(tokenizer.decode(ids[:k], False)) > middle)
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                "max_tokens": max_tokens}
        whole = (await client.chat.completions.create(**body)).choices[0]
        calls, num_argument_chunks, finish = streamed_calls(await read_chunks(client, **{
            k: v for k, v in body.items() if k not in ("model", "messages", "tools")}))
        assert finish == whole.finish_reason == "length"
        assert without_ids(calls) == without_ids(message_calls(whole.message))
        (call_name, arguments), = without_ids(calls)
        assert call_name == "note" and LONG_ARGS.startswith(arguments) and "Dear team" in arguments
        assert num_argument_chunks > 5


async def test_a_stream_resumed_mid_arguments_neither_repeats_nor_loses_a_delta(cluster, make_router):
    """The site writing the call is lost inside its arguments; the router resumes on another site with the
    tokens so far, and the client sees each call open once and its arguments whole."""
    near = await cluster.add_site("fra", 50.1, 8.7)
    async with scripted(cluster, make_router, "hermes") as (client, script, tokenizer):
        far = cluster.agents["oslo"]
        ids = script(calls_text("hermes"))
        near.token_at = far.token_at
        reference = await read_chunks(client, tool_choice="required")
        in_arguments = next(k for k in range(len(ids)) if len(tokenizer.decode(ids[:k], False))
                            > calls_text("hermes").index("revenue"))
        near.die_after = in_arguments
        resumed = await read_chunks(client, tool_choice="required")
        method, resume = far.calls[-1]
        assert method == "Decode" and len(resume.generated_ids) == in_arguments  # resumed, not started over
        calls, _num, finish = streamed_calls(resumed)
        assert without_ids(calls) == without_ids(streamed_calls(reference)[0]) == expected_calls("hermes")
        assert finish == "tool_calls"
        openings = [p for c in resumed if c.choices for p in c.choices[0].delta.tool_calls or () if p.id]
        assert len(openings) == 2


async def test_each_choice_streams_its_own_calls(cluster, make_router):
    async with scripted(cluster, make_router, "mistral_v11") as (client, script, _tokenizer):
        script(calls_text("mistral_v11"))
        chunks = await read_chunks(client, tool_choice="required", n=2)
        whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                                     tool_choice="required", n=2)
        for index in (0, 1):
            calls, num_argument_chunks, finish = streamed_calls(chunks, index)
            assert without_ids(calls) == without_ids(message_calls(whole.choices[index].message)) \
                == expected_calls("mistral_v11")
            assert finish == "tool_calls" and num_argument_chunks > 10
        first_ids = {c["id"] for c in streamed_calls(chunks, 0)[0]}
        assert first_ids.isdisjoint(c["id"] for c in streamed_calls(chunks, 1)[0])
