"""A Llama 3 bare JSON call under `tool_choice: auto` is sent as soon as its object closes, not at the end of the
answer: once the text proves the object a whole call of an offered function (_BareCallScan), the call is certain,
so a streaming client gets its deltas (index, id, name, then its arguments) at once, and the words the model
writes after it stream as content as they are written, as after a marker format's calls. The format's own rule
(`ToolCallFormat.split`) decides what an answer holds: one bare call, and whatever follows it is words (a second
object included), the blank between them layout. With `logprobs`, the call's tokens (its closing one too) and
that blank carry none: logprobs come with the words alone.

At the parser (ToolCallStream), text fed a few characters at a time and whole; through the router, the official
`openai` client against a fake agent scripted to write a chosen text (tests/router/test_tool_calls_edges.py's
`scripted`).
"""

from __future__ import annotations

import json

import pytest
from router_fake_agent import MODEL

from router.tool_calls import FORMATS, ToolCallStream
from tests.router.test_router_tool_calls import CALL_TEXT
from tests.router.test_tool_calls_edges import MESSAGES, TOOLS, answer, scripted

LLAMA3 = FORMATS["llama3_json"]
NAMES = frozenset({"add", "city_time"})
CALL = '{"name": "city_time", "parameters": {"city": "Oslo", "when": ["now", {"tz": "CET"}]}}'
WORDS = "I asked for the time in Oslo; the answer follows."
TEXTS = [
    CALL,
    CALL + "\n\n" + WORDS,
    "  \n" + CALL + " " + WORDS + "\n",
    '{"name": "add"}\n' + WORDS,                                  # no arguments written: "{}", as `split` reads it
    '{"parameters": {"a": 1, "b": 2}, "name": "add"}' + WORDS,   # the arguments first
    # `split` reads one bare call: what follows it, another object included, is words
    CALL + '; {"name": "add", "parameters": {"a": 1, "b": 2}}',
    CALL + '\n{"name": "add", "parameters": {"a": 1, "b": 2}}',
    CALL + '{"name": "add", "parameters": {"a": 1, "b": 2}}',
]


def _feed(text: str, step: int, cut: bool = False, **options):
    """(what each `add` returned, the deltas taken after each, `finish`'s content, its deltas, the calls)."""
    stream = ToolCallStream(LLAMA3, names=NAMES, **options)
    pieces, deltas = [], []
    for i in range(0, len(text), step):
        pieces.append(stream.add(text[i:i + step]))
        deltas.append(stream.take_deltas())
    tail, calls = stream.finish(cut)
    return pieces, deltas, tail, stream.take_deltas(), calls


def _join(deltas: list[dict]) -> list[tuple[str, str, str]]:
    """The calls a client builds from the deltas: (id, name, arguments), the id and name sent once, first."""
    calls: list[list[str]] = []
    for delta in deltas:
        part, = delta["tool_calls"]
        if "id" in part:
            assert part["index"] == len(calls) and part["function"]["arguments"] == "", part
            calls.append([part["id"], part["function"]["name"], ""])
        else:
            assert set(part) == {"index", "function"}, part
            calls[part["index"]][2] += part["function"]["arguments"]
    return [tuple(call) for call in calls]


def _object_end(text: str) -> int:
    start = len(text) - len(text.lstrip())
    return json.JSONDecoder().raw_decode(text, start)[1]


# -- the parser ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [1, 2, 3, 5])
@pytest.mark.parametrize("text", TEXTS)
def test_the_call_is_sent_when_its_object_closes(text, step):
    """The call's deltas come with the piece that closes its object, none before and none at the end; the
    streamed call is `finish`'s (id included) and `split`'s, and the content is `split`'s."""
    pieces, deltas, tail, last, calls = _feed(text, step)
    closing = (_object_end(text) - 1) // step  # the piece holding the object's "}"
    assert not any(deltas[:closing]) and deltas[closing] and not any(deltas[closing + 1:]) and last == []
    assert _join(deltas[closing]) == [(c.id, c.name, c.arguments) for c in calls]
    content, split_calls = LLAMA3.split(text, NAMES)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in split_calls]
    assert "".join(pieces) + tail == content
    assert not any(pieces[:closing])  # nothing of the call is content; the words after it may share its piece
    assert content.startswith(pieces[closing]) and text[:(closing + 1) * step].endswith(pieces[closing])


@pytest.mark.parametrize("text", TEXTS[1:])
def test_the_words_after_the_call_stream_as_they_are_written(text):
    """Fed a character at a time, each character of the words after the call comes out of the `add` that read
    it (the blank between is layout): the words do not wait for the end."""
    pieces, _deltas, tail, _last, _calls = _feed(text, 1)
    content = LLAMA3.split(text, NAMES)[0]
    first_word = _object_end(text) + len(text[_object_end(text):]) - len(text[_object_end(text):].lstrip())
    assert "".join(pieces[first_word:]) == content and tail == ""
    assert all(pieces[first_word:]) and not any(pieces[:first_word])


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_whole_and_unchunked_agree(text):
    """The same content and calls streamed in pieces of any size, read whole (no deltas, as a non-streamed answer
    is) and fed at once; cut by max_tokens anywhere, what streamed is never taken back and the deltas always join
    into the calls `finish` returns."""
    results = set()
    for step in (1, 2, 7, len(text)):
        for deltas_on in (True, False):
            pieces, _deltas, tail, _last, calls = _feed(text, step, deltas=deltas_on)
            results.add(("".join(pieces) + tail, tuple((c.name, c.arguments) for c in calls)))
    assert len(results) == 1, results
    for end in range(1, len(text) + 1):
        for cut in (True, False):
            pieces, deltas, tail, last, calls = _feed(text[:end], 3, cut)
            sent = _join([d for ds in deltas for d in ds])
            assert _join([d for ds in deltas for d in ds] + last) == [(c.id, c.name, c.arguments) for c in calls]
            assert sent == [(c.id, c.name, c.arguments) for c in calls[:len(sent)]], (end, cut)


def test_without_parallel_calls_there_is_one_call():
    for text in TEXTS:
        _pieces, deltas, _tail, last, calls = _feed(text, 4, parallel=False)
        assert len(calls) == 1 and len(_join([d for ds in deltas for d in ds] + last)) == 1


def test_the_closing_and_the_blank_after_it_stay_markup_until_words_follow():
    """`in_calls` (which tokens' logprobs are held back as markup): from the token that proves the call through
    the blank after it; the first word is content."""
    stream = ToolCallStream(LLAMA3, names=NAMES)
    seen, sent = [], []
    for token in ['{"name"', ': "add",', ' "parameters": {"a": 1, "b": 2', "}}", "\n", "\n", "Done", "."]:
        seen.append((stream.add(token), stream.in_calls))
        sent += _join(stream.take_deltas())
    assert seen == [("", False)] * 3 + [("", True)] * 3 + [("Done", False), (".", False)]
    tail, calls = stream.finish()
    assert tail == "" and sent == [(c.id, c.name, c.arguments) for c in calls]
    assert [(name, arguments) for _id, name, arguments in sent] == [("add", '{"a": 1, "b": 2}')]
    assert stream.take_deltas() == []


# -- through the router ----------------------------------------------------------------------------------


async def test_a_llama3_call_reaches_the_client_before_the_answer_ends(cluster, make_router):
    """The call's chunks come before the words after it, and the words come token by token, not at the end;
    streamed and whole answers are the same."""
    async with scripted(cluster, make_router, "llama3_json") as (client, script, _tokenizer):
        script(CALL + "\n\n" + WORDS)
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS}
        events = []  # ("call", index) or ("content", text) or ("finish", reason), in the order they arrived
        async for chunk in await client.chat.completions.create(stream=True, **body):
            for choice in chunk.choices:
                if choice.delta.content:
                    events.append(("content", choice.delta.content))
                for part in choice.delta.tool_calls or ():
                    events.append(("call", part.index))
                if choice.finish_reason:
                    events.append(("finish", choice.finish_reason))
        kinds = [kind for kind, _value in events]
        assert kinds.index("content") > max(i for i, kind in enumerate(kinds) if kind == "call")
        words = [value for kind, value in events if kind == "content"]
        assert "".join(words) == WORDS and len(words) > 3, words
        assert events[-1] == ("finish", "tool_calls")
        whole, streamed = await answer(client)
        assert whole == streamed == {"content": WORDS, "calls": [("city_time", json.dumps(
            json.loads(CALL)["parameters"]))], "finish": "tool_calls"}


@pytest.mark.parametrize("name", ["llama3_json", "mistral", "kimi_k2"])
async def test_logprobs_are_the_words_after_the_calls(cluster, make_router, name):
    """With `logprobs`, the call's tokens (its closing one too) and the blank after it carry none: the logprobs
    streamed are the words', token for token, and the whole answer's."""
    async with scripted(cluster, make_router, name) as (client, script, _tokenizer):
        script(CALL_TEXT[name] + "\n\n" + WORDS)
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "logprobs": True}
        streamed = []
        async for chunk in await client.chat.completions.create(stream=True, **body):
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    assert choice.delta.content and not choice.delta.tool_calls, chunk
                    streamed += [lp.token for lp in choice.logprobs.content]
        whole = (await client.chat.completions.create(**body)).choices[0]
        assert whole.message.content == WORDS and len(whole.message.tool_calls) == 1
        assert [lp.token for lp in whole.logprobs.content] == streamed
        assert "".join(streamed) == WORDS, streamed
