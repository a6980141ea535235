"""Qwen3-Coder's and Seed-OSS's tool calls (formats `qwen3_coder` and `seed_oss`, configurations of KeyValueCalls):
`<tool_call>` (Seed: `<seed:tool_call>`), `<function=NAME>`, a `<parameter=KEY>VALUE</parameter>` per argument,
`</function>`, the closing; against the published templates (tests/engine/chat_templates, SOURCES.md).

Qwen3-Coder's template writes a newline after a value's opening and before its closing (layout, no part of the
value), objects and arrays as JSON and other values with Jinja's `string` (`True`); Seed-OSS's writes values right
between the tags and every non-string with `string` (`{'draft': False}`). The formats are recognised from these
templates and no other stored template changes format (Qwen's and Hermes' `<tool_call>` JSON stays `hermes`); calls
parse, whole and streamed in pieces of any size alike, into OpenAI calls; the grammars of a required, named or
strict call accept exactly well-formed calls following the schema; replayed conversations render through the real
templates and their calls read back; and through the router with the official `openai` client a scripted site's
calls (Seed's after its `<seed:think>` block) reach the client as OpenAI's.
"""

from __future__ import annotations

import json

import pytest
from router_fake_agent import MODEL

from router.reasoning import reasoning_format
from router.tool_calls import FORMATS, tool_call_format
from tests.engine.chat_checkpoints import TEMPLATES
from tests.router.test_router_reasoning import _checkpoint, _client, _ids
from tests.router.tool_call_checks import (deltas_joined, grammar_accepts, grammar_compiler, read_chat_stream,
                                          replayed_conversation, stream_in_pieces)

CODER, SEED = "Qwen-Qwen3-Coder-30B-A3B-Instruct", "ByteDance-Seed-Seed-OSS-36B-Instruct"
TEMPLATE = {"qwen3_coder": CODER, "seed_oss": SEED}
WRITE = {"type": "function", "function": {"name": "write", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["text", "count", "options", "zip"],
    "properties": {
        "text": {"type": "string"}, "count": {"type": "integer"},
        "options": {"type": "object", "additionalProperties": False, "required": ["tags", "draft"],
                    "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                   "draft": {"type": "boolean"}}},
        "zip": {"type": "string"}, "urgent": {"type": "boolean"}}}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}}}}
TOOLS = [WRITE, NOW]
NAMES = frozenset({"write", "now"})
ARGUMENTS = [{"text": 'line one\n  <b>she</b> said "hi"', "count": 3, "options": {"tags": ["a", "b"], "draft": False},
              "zip": "0150", "urgent": True},
             {"zone": "utc"}]
WORDS = "I will write it down.\n"


def _call(fmt: str, name: str, pairs: list[tuple[str, str]]) -> str:
    """A call as the format's template writes it."""
    begin, end, layout = {"qwen3_coder": ("<tool_call>", "</tool_call>", "\n"),
                          "seed_oss": ("<seed:tool_call>", "</seed:tool_call>", "")}[fmt]
    return (f"{begin}\n<function={name}>\n" + "".join(f"<parameter={key}>{layout}{value}{layout}</parameter>\n"
                                                      for key, value in pairs) + f"</function>\n{end}")


def _pairs(fmt: str, **changed) -> list[tuple[str, str]]:
    """`write`'s pairs as the template renders ARGUMENTS[0] (Seed: Python's text of the object), `changed` replacing
    values (None leaves a pair out)."""
    options = '{"tags": ["a", "b"], "draft": false}' if fmt == "qwen3_coder" else "{'tags': ['a', 'b'], 'draft': False}"
    pairs = {"text": ARGUMENTS[0]["text"], "count": "3", "options": options, "zip": "0150", "urgent": "True"}
    pairs.update(changed)
    return [(key, value) for key, value in pairs.items() if value is not None]


def _calls(fmt: str, **changed) -> str:
    return _call(fmt, "write", _pairs(fmt, **changed)) + "\n" + _call(fmt, "now", [("zone", "utc")])


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_the_templates_are_recognised_and_no_other_changes_format(template, template_tokenizer):
    tokenizer = template_tokenizer(template)
    fmt, reasoning = tool_call_format(tokenizer), reasoning_format(tokenizer)
    if template == CODER:
        assert fmt.name == "qwen3_coder" and reasoning is None
    elif template == SEED:
        assert fmt.name == "seed_oss" and reasoning.name == "seed"
    else:
        assert fmt is None or fmt.name not in ("qwen3_coder", "seed_oss")
    if template in ("Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use"):
        assert fmt.name == "hermes"


@pytest.mark.parametrize("fmt_name", sorted(TEMPLATE))
@pytest.mark.parametrize("step", [1, 4, 17, 1000])
def test_two_calls_parse_to_openai_calls_whole_and_streamed_alike(fmt_name, step):
    fmt = FORMATS[fmt_name].with_tools(TOOLS)
    text = WORDS + _calls(fmt_name)
    content, calls = fmt.split(text, NAMES)
    assert content == WORDS
    assert [(c.name, json.loads(c.arguments)) for c in calls] == list(zip(["write", "now"], ARGUMENTS))
    words, streamed, deltas, joined = stream_in_pieces(fmt, NAMES, text, step)
    first_pair_sent_at = next((end for end, so_far in joined if so_far and so_far[0]["arguments"]), None)
    assert words == WORDS
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    assert deltas_joined(deltas) == [{"name": c.name, "arguments": c.arguments} for c in calls]
    # a pair goes out once its value closes, long before the call does
    first_value_end = text.index("</parameter>") + len("</parameter>")
    assert first_pair_sent_at - step < first_value_end <= first_pair_sent_at


def test_values_read_as_the_templates_write_them():
    coder, seed = FORMATS["qwen3_coder"], FORMATS["seed_oss"]
    # Qwen3-Coder: one newline each side is layout; a value's own blank lines and indentation stay
    text = _call("qwen3_coder", "write", [("text", "\n    indented\n"), ("urgent", "False")])
    assert json.loads(coder.with_tools(TOOLS).split(text)[1][0].arguments) == {"text": "\n    indented\n",
                                                                              "urgent": False}
    # Seed: no layout, Python's text of non-strings; without a schema a value is JSON or a Python literal where it
    # is one, else the text
    text = _call("seed_oss", "write", [("text", "\nx"), ("options", "{'tags': [], 'draft': None}"),
                                       ("zip", "0150"), ("count", "3"), ("note", "'quoted'")])
    assert json.loads(seed.split(text)[1][0].arguments) == {"text": "\nx", "options": {"tags": [], "draft": None},
                                                           "zip": "0150", "count": 3, "note": "'quoted'"}
    # a string property keeps what looks like another type as text
    assert json.loads(seed.with_tools(TOOLS).split(text)[1][0].arguments)["zip"] == "0150"


@pytest.mark.parametrize("fmt_name", sorted(TEMPLATE))
def test_a_call_cut_short_keeps_the_pairs_written_and_broken_markup_is_no_call(fmt_name):
    fmt = FORMATS[fmt_name].with_tools(TOOLS)
    calls = _calls(fmt_name)
    _content, (call,) = fmt.split(calls[:calls.index("<parameter=options")], NAMES, cut=True)
    assert json.loads(call.arguments + "}") == {"text": ARGUMENTS[0]["text"], "count": 3}
    ended = calls[:calls.index("</function>")]  # an end of sequence after the last pair: the call closes
    assert json.loads(fmt.split(ended, NAMES)[1][0].arguments) == ARGUMENTS[0]
    broken = calls.replace("<parameter=count>", "<parameter count>")
    assert fmt.split(broken, NAMES) is None


@pytest.mark.parametrize("fmt_name", sorted(TEMPLATE))
@pytest.mark.parametrize("ending", ["</function> left out", "inside the next key", "inside the next call"])
def test_an_answer_that_ends_inside_a_call_has_arguments_that_parse(fmt_name, ending):
    """An end of sequence (not max_tokens) inside a call once its pairs were sent: the finish reason is
    "tool_calls", so the client parses the arguments, which hold the whole pairs written, streamed and whole."""
    fmt, call = FORMATS[fmt_name].with_tools(TOOLS), _call(fmt_name, "now", [("zone", "utc")])
    text = {"</function> left out": call.replace("</function>\n", ""),
            "inside the next key": call.split("</function>")[0] + "<parameter=zo",
            "inside the next call": call + "\n" + call.split("</parameter>")[0]}[ending]
    for step in (1, 5, len(text)):
        _words, calls, deltas, _joined = stream_in_pieces(fmt, NAMES, text, step)
        assert [json.loads(c.arguments) for c in calls] == [{"zone": "utc"}] + [{}] * (ending == "inside the next call")
        assert deltas_joined(deltas) == [{"name": c.name, "arguments": c.arguments} for c in calls]


# -- grammars ------------------------------------------------------------------------------------------


JSON_OPTIONS = '{"tags": ["a", "b"], "draft": false}'
AS_JSON = dict(options=JSON_OPTIONS, urgent="true")  # the grammar writes non-strings as JSON
WRONG = {
    "a string for an integer": dict(count="three"),
    "a nested value of the wrong type": dict(options=JSON_OPTIONS.replace("false", '"no"')),
    "Python's text for an object": dict(options="{'tags': ['a', 'b'], 'draft': False}"),
    "Python's True for a boolean": dict(urgent="True"),
    "a required key left out": dict(count=None),
    "a string value holding the closing tag": dict(text="line </parameter> one"),
}


# Qwen3-0.6B's vocabulary: Qwen3-Coder's tokens, in which `<function=` and `</parameter>` are plain text.
@pytest.mark.parametrize("fmt_name, template", [("qwen3_coder", CODER), ("qwen3_coder", "Qwen-Qwen3-0.6B"),
                                                ("seed_oss", SEED)])
def test_required_named_and_strict_grammars_accept_exactly_well_formed_calls(fmt_name, template, template_tokenizer):
    tokenizer, fmt = template_tokenizer(template), FORMATS[fmt_name]
    compiler = grammar_compiler(tokenizer, template)
    accepts = lambda spec, text: grammar_accepts(compiler, tokenizer, spec, text)  # noqa: E731
    calls = _calls(fmt_name, **AS_JSON)
    first, second = calls.split("\n" + _call(fmt_name, "now", [("zone", "utc")]))[0], _call(fmt_name, "now",
                                                                                             [("zone", "utc")])
    required, single = fmt.grammar(TOOLS, True, tokenizer), fmt.grammar(TOOLS, False, tokenizer)
    named = fmt.grammar([NOW], False, tokenizer)
    auto = fmt.auto_grammar(TOOLS, True, tokenizer)  # `write` is strict
    for spec, text in ((required, calls), (required, first), (single, second), (named, second),
                       (auto, WORDS + calls), (auto, "Just words, no call."),
                       (required, _call(fmt_name, "write", _pairs(fmt_name, **{**AS_JSON, "urgent": None},
                                                                  text="a\n</b>\n"))),
                       (named, _call(fmt_name, "now", []))):  # optional keys left out
        assert accepts(spec, text), text
    assert not accepts(single, calls)  # parallel_tool_calls false: one call
    assert not accepts(named, first)   # a named call: that function only
    wrong = {what: _calls(fmt_name, **{**AS_JSON, **changed}) for what, changed in WRONG.items()}
    wrong |= {
        "a key the schema does not have": calls.replace("<parameter=zip>", "<parameter=postcode>"),
        "keys out of the schema's order": _call(fmt_name, "write", [_pairs(fmt_name)[1], _pairs(fmt_name)[0],
                                                                    *_pairs(fmt_name, **AS_JSON)[2:]]),
        "a value outside the enum of now": calls.replace("utc", "mars"),
        "a function not offered": calls.replace("<function=now>", "<function=later>"),
        "JSON arguments (Hermes' shape)": calls.split("\n<function=")[0] + '\n{"name": "now", "arguments": {}}\n'
                                          + calls.split("</function>\n")[-1],
    }
    for what, text in wrong.items():
        assert not accepts(required, text), what
        if "now" not in what:  # under auto only the strict function's arguments follow its schema
            assert not accepts(auto, WORDS + text), what
    # what the grammar accepts parses to the calls meant
    assert [json.loads(c.arguments) for c in fmt.with_tools(TOOLS).split(calls, NAMES)[1]] == ARGUMENTS


# -- the real templates ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt_name", sorted(TEMPLATE))
def test_a_replayed_conversation_renders_through_the_template_and_its_calls_read_back(fmt_name, template_tokenizer):
    rendered = replayed_conversation(template_tokenizer(TEMPLATE[fmt_name]), TOOLS, ARGUMENTS)
    assert _calls(fmt_name) in rendered  # the shape these tests write is the template's
    turn = rendered[rendered.index("Note it, and the time."):rendered.index("written")]
    _content, read = FORMATS[fmt_name].with_tools(TOOLS).split(turn, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in read] == list(zip(["write", "now"], ARGUMENTS))
    assert rendered.index("written") < rendered.index("12:00")


# -- through the router --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt_name", sorted(TEMPLATE))
async def test_a_site_s_calls_reach_the_openai_client(cluster, make_router, tmp_path, fmt_name):
    """A scripted site writing words (Seed: its thinking first) and two calls: the client gets the calls as OpenAI's,
    streamed and whole the same, the reasoning apart; replayed with their results, the calls reach the site's prompt
    as the template writes them."""
    template = TEMPLATE[fmt_name]
    info, hf = _checkpoint(tmp_path / fmt_name, template)
    info.context_length = 4096  # Qwen3-Coder's tool list in the system prompt takes most of the default 1024
    reasoning = "Two tools to call." if fmt_name == "seed_oss" else ""
    thinking = f"<seed:think>{reasoning}</seed:think>\n" if reasoning else ""
    agents, client = await _client(cluster, make_router, info, _ids(hf, thinking + WORDS + _calls(fmt_name)))
    messages = [{"role": "user", "content": "Note it, and the time."}]
    async with client:
        body = dict(model=MODEL, messages=messages, tools=TOOLS, max_tokens=400)
        whole = (await client.chat.completions.create(**body)).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content == WORDS
        assert (whole.message.model_extra.get("reasoning_content") or "") == reasoning
        assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == \
            list(zip(["write", "now"], ARGUMENTS))
        streamed, thought, content, finish, num_argument_chunks = await read_chat_stream(client, body)
        assert (thought, content, finish) == (reasoning, WORDS, "tool_calls")
        assert streamed == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert num_argument_chunks >= 5  # a piece per pair, not one at the end
        replay = messages + [whole.message.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": c.id, "content": "done"} for c in whole.message.tool_calls]
        await client.chat.completions.create(model=MODEL, messages=replay, tools=TOOLS, max_tokens=8)
        _method, request = agents[0].calls[-1]
        assert _calls(fmt_name) in hf.decode(list(request.prompt_ids))
