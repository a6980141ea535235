"""What is a call, and what of an answer's call markup is never words: a call names an offered function (an
empty name, or one the request did not offer, makes it no call), and markup the answer ends in (the next
call's opening, the section's closing, written in part before an end of sequence or a stop string) never
becomes content. A required call's answer is calls alone, so stop strings do not cut it.

At the parser, every end point of every format's calls, ended or cut, streamed and whole; through the router,
the official `openai` client against a fake agent scripted to write a chosen text.
"""

from __future__ import annotations

import pytest

from router.tool_calls import FORMATS, ToolCallStream
from tests.router.test_router_tool_calls import CALL_TEXT
from tests.router.test_tool_calls_edges import ADD as ADD_TOOL, ARGS, CITY as CITY_TOOL, answer, scripted
from tests.router.test_tool_calls_strict_auto import _two_calls

NAMES = frozenset({"add", "city_time"})


def _calls_text(name: str) -> str:
    fmt = FORMATS[name]
    return _two_calls(fmt, CALL_TEXT[name]) if fmt.parallel else CALL_TEXT[name]


def _read(name: str, text: str, cut: bool, step: int, deltas: bool, **options):
    """(content, calls, the calls as the stream's deltas join them) of `text` read `step` characters at a time."""
    stream = ToolCallStream(FORMATS[name], deltas=deltas, names=NAMES, **options)
    content, streamed = "", {}

    def take() -> None:
        for delta in stream.take_deltas():
            part = delta["tool_calls"][0]
            called, arguments = streamed.get(part["index"], ("", ""))
            streamed[part["index"]] = (called + part["function"].get("name", ""),
                                       arguments + part["function"]["arguments"])

    for i in range(0, len(text), step):
        content += stream.add(text[i:i + step])
        take()
    tail, calls = stream.finish(cut)
    take()
    return content + tail, [(c.name, c.arguments) for c in calls], list(streamed.values())


@pytest.mark.parametrize("name", sorted(CALL_TEXT))
@pytest.mark.parametrize("forced", [True, False], ids=["required", "auto"])
def test_no_markup_an_answer_ends_in_is_content(name, forced):
    """The answer ends after every character of its calls, by an end of sequence or a stop string (not cut) or
    by max_tokens (cut): the words before the calls are its content and nothing more, whatever markup it ended
    in; its calls are the whole answer's so far; streamed and whole agree."""
    words = "" if forced or not FORMATS[name].marker else "Let me add. "  # a bare JSON call opens the answer
    text = words + _calls_text(name)
    for end in range(len(words) + 1, len(text) + 1):
        for cut in (False, True):
            for step in (1, 4):
                content, calls, streamed = _read(name, text[:end], cut, step, True, forced=forced)
                whole = _read(name, text[:end], cut, step, False, forced=forced)[:2]
                where = (text[:end], cut, step)
                assert (content, calls) == whole and streamed == calls, where
                assert all(called == "add" and ARGS.startswith(arguments) for called, arguments in calls), where
                if calls or forced:  # no call yet under auto: what was written may be words, as it was
                    assert content == words, where
    content, calls, _streamed = _read(name, text, False, 3, True, forced=forced)
    assert content == words and calls == [("add", ARGS)] * (2 if FORMATS[name].parallel else 1)


@pytest.mark.parametrize("name", sorted(n for n in CALL_TEXT if FORMATS[n].name_key))
def test_a_call_without_an_offered_name_is_no_call(name):
    for called in ("", "drop_tables"):
        text = CALL_TEXT[name].replace('"add"', f'"{called}"')
        assert _read(name, text, False, 3, True) == (text, [], [])


async def test_an_empty_name_is_no_call_through_the_router(cluster, make_router):
    async with scripted(cluster, make_router, "mistral") as (client, script, _tokenizer):
        for called in ("", "drop_tables"):
            text = f'[TOOL_CALLS][{{"name": "{called}", "arguments": {{"a": 1, "b": 2}}}}]'
            script(text)
            whole, streamed = await answer(client)
            assert whole == streamed == {"content": text, "calls": [], "finish": "stop"}


@pytest.mark.parametrize(("name", "tail"), [("hermes", "\n<"), ("hermes", "\n<tool_c"), ("mistral_v11", "["),
                                            ("kimi_k2", "<|tool_calls_sec")])
@pytest.mark.parametrize("tool_choice", ["required", "auto"])
async def test_markup_after_the_calls_is_not_content(cluster, make_router, name, tail, tool_choice):
    """An answer that ends, not cut by max_tokens, in the first characters of more markup after its calls."""
    text = CALL_TEXT[name]
    if FORMATS[name].section_end:
        text = text[:-len(FORMATS[name].section_end)]
    async with scripted(cluster, make_router, name) as (client, script, _tokenizer):
        script(text + tail)
        whole, streamed = await answer(client, tool_choice=tool_choice)
        assert whole == streamed == {"content": None, "calls": [("add", ARGS)], "finish": "tool_calls"}


async def test_a_stop_string_does_not_cut_a_required_call(cluster, make_router):
    """Stop strings apply to words: inside a required call's arguments they would leave JSON that does not
    parse, under finish reason "tool_calls"."""
    async with scripted(cluster, make_router, "hermes") as (client, script, _tokenizer):
        script(_calls_text("hermes"))
        whole, streamed = await answer(client, tool_choice="required", stop=['"b"', "}"])
        assert whole == streamed == {"content": None, "calls": [("add", ARGS)] * 2, "finish": "tool_calls"}


async def test_a_call_written_inside_the_reasoning_is_no_call(cluster, make_router, tmp_path):
    """Qwen3 thinks, writing a call's text in its thoughts, then calls: the thoughts are reasoning_content only,
    as the model wrote them (its `<tool_call>` markers are special tokens, which the reasoning keeps), the one
    call is the one after the block, and its deltas come after every piece of reasoning."""
    from tests.router.test_router_reasoning import USER, _checkpoint, _client, _ids

    info, hf = _checkpoint(tmp_path / "qwen3", "Qwen-Qwen3-0.6B")
    think, end_think = hf.convert_tokens_to_ids("<think>"), hf.convert_tokens_to_ids("</think>")
    thought = '\nI could write <tool_call>\n{"name": "city_time", "arguments": {"city": "Oslo"}}\n</tool_call>.\n'
    script = [think, *_ids(hf, thought), end_think, *_ids(hf, "\n\n" + CALL_TEXT["hermes"])]
    assert "<tool_call>" not in hf.decode(_ids(hf, thought), skip_special_tokens=True)  # the markers are special
    _agents, client = await _client(cluster, make_router, info, script)
    body = {"model": "tiny-llama", "messages": USER, "tools": [ADD_TOOL, CITY_TOOL], "max_tokens": 200}
    async with client:
        message = (await client.chat.completions.create(**body)).choices[0].message
        assert message.model_extra["reasoning_content"] == thought.lstrip()
        assert message.content is None
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("add", ARGS)]
        kinds, reasoning, calls = [], "", []
        async for chunk in await client.chat.completions.create(stream=True, **body):
            for choice in chunk.choices:
                if (choice.delta.model_extra or {}).get("reasoning_content"):
                    kinds.append("reasoning")
                    reasoning += choice.delta.model_extra["reasoning_content"]
                if choice.delta.tool_calls:
                    kinds.append("call")
                    calls += choice.delta.tool_calls
                assert not choice.delta.content
        assert reasoning == thought.lstrip() and "call" in kinds
        assert kinds == sorted(kinds, key=lambda kind: kind == "call")
        assert [c.function.name for c in calls if c.id] == ["add"]
        assert "".join(c.function.arguments or "" for c in calls) == ARGS


@pytest.mark.parametrize("name", sorted(n for n in CALL_TEXT if FORMATS[n].marker))
async def test_a_stop_string_ends_the_words_not_a_call_under_auto(cluster, make_router, name):
    """Under auto, a stop string in the words before the calls ends the answer there; one that the calls'
    arguments hold (here `"b"` and `}`) does not cut a call into JSON that does not parse."""
    async with scripted(cluster, make_router, name) as (client, script, _tokenizer):
        script("Let me add. " + _calls_text(name))
        whole, streamed = await answer(client, stop=['"b"', "}"])
        calls = [("add", ARGS)] * (2 if FORMATS[name].parallel else 1)
        assert whole == streamed == {"content": "Let me add. ", "calls": calls, "finish": "tool_calls"}
        whole, streamed = await answer(client, stop=["add."])
        assert whole == streamed == {"content": "Let me ", "calls": [], "finish": "stop"}
