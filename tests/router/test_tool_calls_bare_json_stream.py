"""Llama 3's bare JSON under `tool_choice: auto`: an answer that opens with `{` streams as content as soon as the
text written so far shows it cannot be a call (an object of just an offered function's name and its object
arguments, each once), and only what may still be a call is held back.

At the parser (ToolCallStream), text fed a character or a few at a time: each proof point releases the text
held so far at the character that proves it; a real call stays a call, its streamed deltas joining into the
calls `finish` returns (ids included); the content and calls never depend on how the text was cut into pieces,
cut by max_tokens or not, and text sent is never taken back. Through the router, the official `openai` client
against a fake agent scripted to write a JSON answer (tests/router/test_tool_calls_edges.py's `scripted`).
"""

from __future__ import annotations

import json

import pytest
from router_fake_agent import MODEL

from router.tool_calls import FORMATS, ToolCallStream
from tests.router.test_tool_calls_edges import MESSAGES, TOOLS, answer, scripted

LLAMA3 = FORMATS["llama3_json"]
NAMES = frozenset({"add", "city_time"})
# A JSON answer a user asked for, with a `name` field as many records have.
RECORD = json.dumps({"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"],
                     "notes": {"engine": "Analytical", "year": 1843}})


def _pieces(text: str) -> tuple[list[str], str, list]:
    """(what each `add` returned, what `finish` returned, the calls) of `text` fed a character at a time."""
    stream = ToolCallStream(LLAMA3, names=NAMES)
    pieces = [stream.add(char) for char in text]
    tail, calls = stream.finish()
    return pieces, tail, calls


def _split(text: str, step: int, cut: bool = False, **options) -> tuple[str, str, list[tuple[str, str]]]:
    """(the content sent before the end, all the content, the calls) of `text` fed `step` characters at a time."""
    stream = ToolCallStream(LLAMA3, names=NAMES, **options)
    early = "".join(stream.add(text[i:i + step]) for i in range(0, len(text), step))
    tail, calls = stream.finish(cut)
    return early, early + tail, [(call.name, call.arguments) for call in calls]


# Each: an answer that is no call, and the text up to (and with) the character that proves it.
PROOFS = {
    "another key first": ('{"city": "Oslo", "sky": "snow"}', '{"c'),
    "a name no offered function's begins with": ('{"name": "Ada Lovelace", "born": 1815}', '{"name": "A'),
    "a name closing on no offered function": ('{"name": "ad", "parameters": {}}', '{"name": "ad"'),
    "an empty name": ('{"name": "", "parameters": {}}', '{"name": ""'),
    "a name that is no string": ('{"name": 42, "parameters": {}}', '{"name": 4'),
    "arguments that are no object": ('{"name": "add", "parameters": [1, 2]}', '{"name": "add", "parameters": ['),
    "another member after both": ('{"name": "add", "parameters": {"a": 1, "b": 2}, "note": "sum"}',
                                  '{"name": "add", "parameters": {"a": 1, "b": 2},'),
    "a key written twice": ('{"name": "add", "name": "city_time"}', '{"name": "add", "n'),
    "arguments that break as JSON": ('{"name": "add", "parameters": {"a": 1,, "b": 2}}',
                                     '{"name": "add", "parameters": {"a": 1,,'),
    "a member that breaks the object": ('{"name": "add" "parameters": {}}', '{"name": "add" "'),
    "an object with no name": ('{"parameters": {"a": 1}}', '{"parameters": {"a": 1}}'),
    "an empty object": ("{}", "{}"),
}


@pytest.mark.parametrize("case", sorted(PROOFS))
def test_an_answer_streams_from_the_character_that_proves_it_no_call(case):
    text, proof = PROOFS[case]
    pieces, tail, calls = _pieces(text)
    proved = len(proof) - 1
    assert "".join(pieces[:proved]) == ""  # until then it may still be a call: held
    assert "".join(pieces[:proved + 1]) == proof  # all held so far comes at once
    assert all(pieces[proved + 1:]) and "".join(pieces) + tail == text and calls == []


@pytest.mark.parametrize("answer_or_calls", [False, True], ids=["auto", "auto with a response format"])
def test_a_json_answer_streams_before_it_ends(answer_or_calls):
    """A user asked a Llama 3 model for JSON with tools offered: the record arrives as it is written, not at its
    end, alone or with a response format (where the grammar lets the answer be JSON or calls)."""
    stream = ToolCallStream(LLAMA3, names=NAMES, answer_or_calls=answer_or_calls)
    pieces = [stream.add(RECORD[i:i + 3]) for i in range(0, len(RECORD), 3)]
    tail, calls = stream.finish()
    assert "".join(pieces) + tail == RECORD and calls == []
    assert sum(1 for piece in pieces if piece) >= len(pieces) - 5  # from `"Ada` on, every piece as it came
    assert pieces[-1] and tail == ""


@pytest.mark.parametrize("text", [
    '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    ' \n{"name":"city_time","parameters":{"city":"Oslo"}}\n',
    '{"parameters": {"a": 1, "b": 2}, "name": "add"}',
    '{"name": "add"}',
    '{"n\\u0061me": "add", "parameters": {"a": 1, "b": 2}}',
])
def test_a_call_of_an_offered_function_stays_a_call(text):
    for step in (1, 2, 5):
        streamed = ToolCallStream(LLAMA3, names=NAMES)
        whole = ToolCallStream(LLAMA3, names=NAMES, deltas=False)
        content = "".join(streamed.add(text[i:i + step]) + whole.add(text[i:i + step])
                          for i in range(0, len(text), step))
        (tail, calls), (whole_tail, whole_calls) = streamed.finish(), whole.finish()
        assert content + tail + whole_tail == "" and len(calls) == 1
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [(c.name, json.loads(c.arguments))
                                                                      for c in whole_calls]
        assert calls[0].name in NAMES and json.loads(calls[0].arguments) == json.loads(text).get("parameters", {})
        deltas = streamed.take_deltas()
        assert deltas[0]["tool_calls"][0]["id"] == calls[0].id  # the id the client was sent is the call's
        assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == calls[0].arguments


def test_what_may_still_be_a_call_is_held():
    """A name that an offered function's begins with, an object whose arguments are still being written: held."""
    for text in ('{"name": "ad', '{"name": "add", "par', '{"name": "add", "parameters": {"a": 1, "b": [2, {"c"',
                 '{"parameters": {"a": 1}, "na', '{"name": "city_time", "parameters": {}'):
        stream = ToolCallStream(LLAMA3, names=NAMES)
        assert [stream.add(char) for char in text] == [""] * len(text), text


ANSWERS = [RECORD, *(text for text, _proof in PROOFS.values()),
           '{"name": "add", "parameters": {"a": 1, "b": 2}}',
           '{"name": "add", "parameters": {"a": 1, "b": 2}} I added them.',
           '{"name": "add", "parameters": {"a": 1}}{"name": "city_time", "parameters": {}}',
           '{"name": "city_time", "parameters": {"city": "Oslo"}, "parameters": {"city": "Rome"}}',
           '{"name": "add", "parameters": {"a": NaN}}',
           '  {"name": "add\\u0020x", "parameters": {}}', "[1, 2]", "Sure: {}"]


@pytest.mark.parametrize("text", ANSWERS)
def test_the_answer_never_depends_on_how_it_was_cut_into_pieces(text):
    """Streamed in pieces of any size, cut by max_tokens anywhere or not: the same content and calls (what a whole
    answer returns, read the same way), content sent is never taken back (an answer that sent some of its
    object is no call; a call's words after it stream, none of its object), and a whole answer is read by the
    format's own rule (`split`)."""
    for end in range(1, len(text) + 1):
        cut = end < len(text)
        results = {step: _split(text[:end], step, cut) for step in (1, 2, 3, 7, len(text))}
        contents_and_calls = {(content, tuple(calls)) for _early, content, calls in results.values()}
        assert len(contents_and_calls) == 1, (end, results)
        for early, content, calls in results.values():
            assert content.startswith(early)
            if early.strip() and text.lstrip().startswith("{"):
                assert calls == [] or content == LLAMA3.split(text[:end], NAMES, cut)[0], (end, early, calls)
    split = LLAMA3.split(text, NAMES)
    _early, content, calls = _split(text, 1)
    assert calls == ([(c.name, c.arguments) for c in split[1]] if split else [])
    assert content == (split[0] if split else text)


# -- through the router ----------------------------------------------------------------------------------


async def test_a_llama3_json_answer_streams_to_the_client(cluster, make_router):
    """The client streaming a JSON answer from a Llama 3 model offered tools gets it in pieces as it is written,
    the same text and logprobs as the whole answer; a call of an offered tool is still a call."""
    async with scripted(cluster, make_router, "llama3_json") as (client, script, _tokenizer):
        ids = script(RECORD)
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "logprobs": True}
        pieces, logprob_tokens, finish = [], [], None
        async for chunk in await client.chat.completions.create(stream=True, **body):
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                if choice.logprobs is not None:
                    logprob_tokens += [lp.token for lp in choice.logprobs.content]
                assert not choice.delta.tool_calls
                finish = choice.finish_reason or finish
        assert "".join(pieces) == RECORD and finish == "stop"
        assert len(pieces) >= len(ids) - 8  # token by token from the name on, not one piece at the end
        whole = (await client.chat.completions.create(**body)).choices[0]
        assert whole.message.content == RECORD and not whole.message.tool_calls
        assert [lp.token for lp in whole.logprobs.content] == logprob_tokens and "".join(logprob_tokens) == RECORD
        whole, streamed = await answer(client)
        assert whole == streamed == {"content": RECORD, "calls": [], "finish": "stop"}
        script('{"name": "city_time", "parameters": {"city": "Oslo"}}')
        whole, streamed = await answer(client)
        assert whole == streamed == {"content": None, "calls": [("city_time", '{"city": "Oslo"}')],
                                     "finish": "tool_calls"}
