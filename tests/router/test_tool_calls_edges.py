"""Tool calls at their edges, as a client sees them: calls cut by max_tokens, a Llama 3 answer that is a JSON
object with a `name`, and words the model writes after its calls.

Through the router and the official `openai` client, streamed and whole, against a fake agent scripted to
write a chosen text (the router is told the model's tool-call format in `tool_call_parsers`), and against a
real engine whose required calls the grammar shapes; and at the parser, every cut point of every format.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import openai
import pytest
from router_fake_agent import MODEL

from engine.tokenizer import ChatTokenizer
from router.tool_calls import FORMATS, ToolCallStream
from tests.router.test_router_structured import ADD as BOUNDED_ADD, MODEL as QWEN, QUESTION, WEATHER, serving
from tests.router.test_router_structured import model_dir  # noqa: F401 (fixture)
from tests.router.test_router_tool_calls import CALL_TEXT
from tests.router.test_tool_calls_strict_auto import _two_calls

CITY = {"type": "function", "function": {"name": "city_time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = [ADD, CITY]
ARGS = '{"a": 1, "b": 2}'  # the arguments of every call in CALL_TEXT, as json.dumps writes them
MESSAGES = [{"role": "user", "content": "Add 1 and 2, twice."}]


def _calls_text(name: str) -> str:
    """The format's text of its most calls in one answer: two of `add` where it can hold several."""
    fmt = FORMATS[name]
    return _two_calls(fmt, CALL_TEXT[name]) if fmt.parallel else CALL_TEXT[name]


def _streamed_split(fmt, text: str, cut: bool, **options) -> tuple[str, list[tuple[str, str]]]:
    """(content, calls) of `text` streamed 3 characters at a time, as the router splits an answer."""
    stream = ToolCallStream(fmt, **options)
    content = "".join(stream.add(text[i:i + 3]) for i in range(0, len(text), 3))
    tail, calls = stream.finish(cut)
    return content + tail, [(c.name, c.arguments) for c in calls]


# -- the parser ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CALL_TEXT))
def test_calls_cut_at_every_point_come_back_as_far_as_they_got(name):
    """A required call sequence cut after every character: the completed calls are calls, the one it ends in
    has its name and the arguments written so far (a prefix of what the whole answer's call has), a call
    whose name is not yet whole is left out, and no markup is ever content."""
    fmt, text = FORMATS[name], _calls_text(name)
    whole = _streamed_split(fmt, text, cut=True, forced=True)
    assert whole == ("", [("add", ARGS)] * len(whole[1])) and len(whole[1]) == (2 if fmt.parallel else 1)
    num_calls = 0
    for end in range(len(text)):
        content, calls = _streamed_split(fmt, text[:end], cut=True, forced=True)
        assert content == "", (end, text[:end])
        assert all(call == ("add", ARGS) for call in calls[:-1]), (end, calls)
        if calls:
            assert calls[-1][0] == "add" and ARGS.startswith(calls[-1][1]), (end, text[:end], calls)
        assert len(calls) >= num_calls, (end, calls)  # more text never takes a call back
        num_calls = len(calls)
    assert num_calls == len(whole[1])


@pytest.mark.parametrize("name", sorted(n for n in CALL_TEXT if FORMATS[n].marker))
def test_under_auto_the_words_before_a_cut_call_stay_and_its_markup_goes(name):
    fmt = FORMATS[name]
    words = "Let me add these. "
    text = words + _calls_text(name)
    marker_end = len(words) + len(fmt.marker)
    cut_in_name = text.index("add", marker_end) + 2
    assert _streamed_split(fmt, text[:cut_in_name], cut=True) == (words, [])
    content, calls = _streamed_split(fmt, text[:text.index('"b"', marker_end)], cut=True)
    assert content == words and calls == [("add", '{"a": 1, ')]
    # noise after the marker is no call's beginning: the text is content, as it was
    noise = words + fmt.marker + " is what I would write"
    assert _streamed_split(fmt, noise, cut=True) == (noise, [])


def test_a_cut_json_object_under_auto_stays_the_answer():
    """Llama 3 calls are bare JSON: an object cut before its name is whole may be the answer, not a call."""
    fmt, names = FORMATS["llama3_json"], frozenset({"add", "city_time"})
    assert _streamed_split(fmt, '{"na', cut=True, names=names) == ('{"na', [])
    assert _streamed_split(fmt, '{"name": "Ada", "bo', cut=True, names=names) == ('{"name": "Ada", "bo', [])
    assert _streamed_split(fmt, '{"name": "add", "parameters": {"a', cut=True, names=names) == ("", [("add", '{"a')])


@pytest.mark.parametrize("name", sorted(CALL_TEXT))
def test_words_after_the_calls_are_content(name):
    fmt = FORMATS[name]
    content, calls = _streamed_split(fmt, _calls_text(name) + "\n\nBoth sums are on their way.", cut=False,
                                     names=frozenset({"add"}))
    assert content == "Both sums are on their way." and calls == [("add", ARGS)] * (2 if fmt.parallel else 1)


# -- through the router ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def scripted(cluster, make_router, fmt: str):
    """(openai client, script(text) -> its token ids, tokenizer) for a router that reads `fmt` calls from a fake
    agent writing `text`."""
    agent = await cluster.add_site("oslo", 59.9, 10.7)
    tokenizer = ChatTokenizer(cluster.model_info.tokenizer_json, json.loads(cluster.model_info.tokenizer_config_json))

    def script(text: str) -> list[int]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        agent.token_at = lambda _prompt, position: ids[position] if position < len(ids) else agent.eos_id
        return ids

    key = await cluster.create_key()
    _router, url = await make_router(tool_call_parsers={MODEL: fmt})
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30) as client:
        yield client, script, tokenizer


async def answer(client, **body) -> tuple[dict, dict]:
    """The whole response's choice and the streamed one's, joined, in one shape: content (None for none),
    calls [(name, arguments)] and finish reason."""
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, **body}
    whole = (await client.chat.completions.create(**body)).choices[0]
    content, calls, finish = "", {}, None
    async for chunk in await client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or ():
                name, arguments = calls.setdefault(part.index, ("", ""))
                calls[part.index] = (name + (part.function.name or ""), arguments + (part.function.arguments or ""))
            finish = choice.finish_reason or finish
    streamed = {"content": content or None, "calls": list(calls.values()), "finish": finish}
    message = whole.message
    return ({"content": message.content or None, "finish": whole.finish_reason,
             "calls": [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]}, streamed)


@pytest.mark.parametrize("name", ["hermes", "mistral", "mistral_v11", "deepseek_v3", "kimi_k2", "llama3_json"])
async def test_a_required_call_sequence_cut_by_max_tokens_comes_back_as_calls(cluster, make_router, name):
    text = _calls_text(name)
    last_args = text.rindex(ARGS)
    async with scripted(cluster, make_router, name) as (client, script, tokenizer):
        ids = script(text)
        # the fewest tokens that reach into the last call's arguments, past its first key
        max_tokens = next(k for k in range(len(ids)) if len(tokenizer.decode(ids[:k], False)) > last_args + 4)
        cut_text = tokenizer.decode(ids[:max_tokens], False)
        whole, streamed = await answer(client, tool_choice="required", max_tokens=max_tokens)
        assert whole == streamed
        num_calls = 2 if FORMATS[name].parallel else 1
        assert whole == {"content": None, "finish": "length",
                         "calls": [("add", ARGS)] * (num_calls - 1) + [("add", cut_text[last_args:])]}
        # cut before the first call's name is whole: no call, and none of its markup as the answer
        in_name = next(k for k in range(len(ids)) if len(tokenizer.decode(ids[:k], False)) > text.index("add") + 1)
        whole, streamed = await answer(client, tool_choice="required", max_tokens=in_name)
        assert whole == streamed == {"content": None, "calls": [], "finish": "length"}
        # not cut: the calls and "tool_calls"
        whole, streamed = await answer(client, tool_choice="required", max_tokens=len(ids) + 4)
        assert whole == streamed == {"content": None, "calls": [("add", ARGS)] * num_calls, "finish": "tool_calls"}


async def test_a_json_answer_with_a_name_is_no_llama3_call(cluster, make_router):
    """A user asks for a JSON record; the model's answer has a `name` field. Only an object of a declared
    tool's name and its parameters is a call."""
    async with scripted(cluster, make_router, "llama3_json") as (client, script, _tokenizer):
        for record in ('{"name": "Ada Lovelace", "born": 1815, "field": "mathematics"}',
                       '{"name": "Ada Lovelace", "parameters": {"born": 1815}}',   # a call's shape, no tool's name
                       '{"name": "city_time", "parameters": {"city": "Oslo"}, "note": "x"}'):  # not a call's shape
            script(record)
            whole, streamed = await answer(client)
            assert whole == streamed == {"content": record, "calls": [], "finish": "stop"}
        script('{"name": "city_time", "parameters": {"city": "Oslo"}}')
        whole, streamed = await answer(client)
        assert whole == streamed == {"content": None, "calls": [("city_time", '{"city": "Oslo"}')],
                                     "finish": "tool_calls"}


@pytest.mark.parametrize("name", ["mistral_v11", "deepseek_v3", "kimi_k2", "hermes"])
async def test_words_after_the_calls_reach_the_client(cluster, make_router, name):
    async with scripted(cluster, make_router, name) as (client, script, _tokenizer):
        script("I will add them. " + _calls_text(name) + " Both sums are on their way.")
        whole, streamed = await answer(client)
        assert whole == streamed == {"content": "I will add them. Both sums are on their way.",
                                     "calls": [("add", ARGS)] * 2, "finish": "tool_calls"}


async def test_a_real_required_call_cut_by_max_tokens_is_a_prefix_of_the_uncut_one(cluster, make_router,
                                                                                    model_dir):  # noqa: F811
    """A random-weight model writes noise, which the grammar shapes into calls: cut by max_tokens, the same
    seeded answer comes back as the uncut one's call so far, with its arguments so far, streamed or whole."""
    async with serving(cluster, make_router, model_dir, QWEN) as (client, _engine):
        async def ask(seed: int, max_tokens: int) -> tuple[dict, dict]:
            body = {"model": QWEN, "messages": QUESTION, "tools": [WEATHER, BOUNDED_ADD], "tool_choice": "required",
                    "seed": seed, "parallel_tool_calls": False, "temperature": 1.0, "max_tokens": max_tokens}
            return await answer(client, **body)

        cases = [(seed, max_tokens) for seed in range(3) for max_tokens in (120, 16, 20, 24, 28)]
        answers = dict(zip(cases, await asyncio.gather(*(ask(*case) for case in cases))))
    num_cut_in_arguments = 0
    for (seed, max_tokens), (whole, streamed) in answers.items():
        assert whole == streamed, (seed, max_tokens)
        full = answers[seed, 120][0]
        assert full["finish"] == "tool_calls" and len(full["calls"]) == 1
        if whole["finish"] != "length":
            continue
        assert whole["content"] is None
        if whole["calls"]:
            (name, arguments), = whole["calls"]
            assert name == full["calls"][0][0] and full["calls"][0][1].startswith(arguments), (whole, full)
            num_cut_in_arguments += arguments not in ("", full["calls"][0][1])
    assert num_cut_in_arguments >= 2
