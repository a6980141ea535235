"""Answers that mix words and calls under `tool_choice: auto`, as a client sees them: words written after the
calls stream as they are written (only what may still open more markup is held back), a call of a function the
request did not offer is left out of an answer that holds other calls (logged and counted, its markup never
content), and with `logprobs` the tokens of call markup carry none: logprobs come with content alone.

At the parser, every format read a few characters at a time; through the router, the official `openai` client
against a fake agent scripted to write a chosen text (tests/router/test_tool_calls_edges.py's `scripted`).
"""

from __future__ import annotations

import logging

import pytest
from router_fake_agent import MODEL

from router.tool_calls import FORMATS, ToolCallStream
from tests.router.test_router_tool_calls import CALL_TEXT
from tests.router.test_tool_calls_edges import ARGS, MESSAGES, TOOLS, answer, scripted
from tests.router.test_tool_calls_strict_auto import _two_calls

NAMES = frozenset({"add", "city_time"})
MARKED = sorted(n for n in CALL_TEXT if FORMATS[n].marker)
PARALLEL = [n for n in MARKED if FORMATS[n].parallel]
WORDS = "Both sums are on their way."


def _read(name: str, text: str, step: int = 3) -> tuple[list[str], str, list[tuple[str, str]], ToolCallStream]:
    """(the content `add` returned piece by piece, the content `finish` returned, the calls, the stream)."""
    stream = ToolCallStream(FORMATS[name], names=NAMES)
    pieces = [stream.add(text[i:i + step]) for i in range(0, len(text), step)]
    tail, calls = stream.finish()
    return pieces, tail, [(c.name, c.arguments) for c in calls], stream


def _unoffered(name: str) -> str:
    return CALL_TEXT[name].replace("add", "drop_tables")


# -- the parser ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MARKED)
def test_words_after_the_calls_stream_as_written(name):
    calls = _two_calls(FORMATS[name], CALL_TEXT[name]) if FORMATS[name].parallel else CALL_TEXT[name]
    pieces, tail, found, _stream = _read(name, "I will add them. " + calls + "\n\n" + WORDS)
    assert "".join(pieces) == "I will add them. " + WORDS and tail == ""
    assert found == [("add", ARGS)] * (2 if FORMATS[name].parallel else 1)
    # each piece of the words came as it was read, not all at the end
    assert sum(1 for piece in pieces[-len(WORDS) // 3:] if piece) >= len(WORDS) // 3 - 1


@pytest.mark.parametrize("name", MARKED)
def test_after_the_calls_only_what_may_open_more_markup_is_held(name):
    """Words after the calls that end in the start of the marker hold that start back (as before the calls), and
    more calls after words are calls."""
    fmt = FORMATS[name]
    stream = ToolCallStream(fmt, names=NAMES)
    assert stream.add(CALL_TEXT[name]) == ""
    assert stream.add(" See " + fmt.marker[:2]) == "See "
    assert stream.add(fmt.marker[2:] + CALL_TEXT[name][len(fmt.marker):]) == ""
    assert stream.add(" Done.") == "Done."
    content, calls = stream.finish()
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("add", ARGS)] * 2


@pytest.mark.parametrize("name", PARALLEL)
@pytest.mark.parametrize("order", ["offered_first", "unoffered_first"])
def test_a_call_of_no_offered_function_beside_others_is_left_out(name, order):
    fmt = FORMATS[name]
    good, bad = CALL_TEXT[name], _unoffered(name)
    if fmt.section_begin:  # two calls in one section
        inner = [c[len(fmt.section_begin):len(c) - len(fmt.section_end)] for c in (good, bad)]
        if fmt.array:
            inner = [c[1:-1] for c in inner]
            sep = ", "
        else:
            sep = fmt.separator
        first, second = inner if order == "offered_first" else inner[::-1]
        body = first + sep + second
        calls = fmt.section_begin + ("[" + body + "]" if fmt.array else body) + fmt.section_end
    else:
        calls = good + fmt.separator + bad if order == "offered_first" else bad + fmt.separator + good
    text = "I will add them. " + calls + " " + WORDS
    for step in (1, 4):
        pieces, tail, found, stream = _read(name, text, step)
        assert "".join(pieces) + tail == "I will add them. " + WORDS, (step, pieces, tail)
        assert found == [("add", ARGS)] and stream.dropped == ["drop_tables"]
        whole = fmt.split(text, NAMES)
        assert whole is not None and whole[0] == "I will add them. " + WORDS
        assert [(c.name, c.arguments) for c in whole[1]] == found


def test_a_call_of_no_offered_function_alone_is_still_the_answer():
    """With no call of an offered function the answer has no calls: what the model wrote is its content."""
    text = "Hm. " + _unoffered("hermes") + " " + WORDS
    pieces, tail, found, stream = _read("hermes", text)
    assert "".join(pieces) + tail == text and found == [] and stream.dropped == []


# -- through the router ----------------------------------------------------------------------------------


async def _chunks(client, **body) -> list:
    return [chunk async for chunk in await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True, **body)]


@pytest.mark.parametrize("name", ["hermes", "mistral", "kimi_k2"])
async def test_words_after_the_calls_reach_the_client_as_they_are_written(cluster, make_router, name):
    async with scripted(cluster, make_router, name) as (client, script, _tokenizer):
        script("I will add them. " + CALL_TEXT[name] + "\n\n" + WORDS)
        chunks = await _chunks(client)
        after_calls = False
        words = []
        for chunk in chunks:
            for choice in chunk.choices:
                after_calls = after_calls or bool(choice.delta.tool_calls)
                if after_calls and choice.delta.content:
                    words.append(choice.delta.content)
        assert "".join(words) == WORDS and len(words) > 3, words  # one chunk per token, not one at the end
        whole, streamed = await answer(client)
        assert whole == streamed == {"content": "I will add them. " + WORDS, "calls": [("add", ARGS)],
                                     "finish": "tool_calls"}


@pytest.mark.parametrize("name", ["hermes", "mistral_v11", "kimi_k2"])
async def test_a_call_of_no_offered_function_after_a_call_is_left_out(cluster, make_router, name, caplog):
    captured = []

    async def router_of(**settings):
        router, url = await make_router(**settings)
        captured.append(router)
        return router, url

    fmt = FORMATS[name]
    if fmt.section_begin:
        inner = [c[len(fmt.section_begin):len(c) - len(fmt.section_end)] for c in (CALL_TEXT[name], _unoffered(name))]
        calls = fmt.section_begin + inner[0] + fmt.separator + inner[1] + fmt.section_end
    else:
        calls = CALL_TEXT[name] + fmt.separator + _unoffered(name)
    async with scripted(cluster, make_router=router_of, fmt=name) as (client, script, _tokenizer):
        script("I will add them. " + calls + " " + WORDS)
        with caplog.at_level(logging.WARNING, logger="router.completions"):
            whole, streamed = await answer(client)
        assert whole == streamed == {"content": "I will add them. " + WORDS, "calls": [("add", ARGS)],
                                     "finish": "tool_calls"}
        assert caplog.text.count("'drop_tables', not offered by the request") == 2  # once per answer
        assert captured[0].metrics.tool_calls_dropped.labels(MODEL)._value.get() == 2


async def test_logprobs_come_with_content_and_never_beside_a_call(cluster, make_router):
    """OpenAI's `logprobs.content` covers content tokens: a chunk that carries a call's arguments carries no
    content, not even an empty one, and the logprobs streamed are the whole answer's, token for token the
    words' own."""
    async with scripted(cluster, make_router, "hermes") as (client, script, tokenizer):
        script("I will add them. " + CALL_TEXT["hermes"] + "\n\n" + WORDS)
        chunks = await _chunks(client, logprobs=True)
        streamed = []
        for chunk in chunks:
            for choice in chunk.choices:
                if choice.delta.tool_calls:
                    assert choice.delta.content is None and choice.logprobs is None, chunk
                if choice.logprobs is not None:
                    assert choice.delta.content, chunk  # logprobs ride with the content they are of
                    streamed += [lp.token for lp in choice.logprobs.content]
        whole = (await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                                      logprobs=True)).choices[0]
        assert [lp.token for lp in whole.logprobs.content] == streamed
        content_ids = tokenizer.encode("I will add them. ", add_special_tokens=False)
        assert "".join(streamed).startswith(tokenizer.decode(content_ids, skip_special_tokens=False))
        assert "".join(streamed).endswith(WORDS) and "tool_call" not in "".join(streamed)
