"""Qwen3-Coder's (and Seed-OSS's) slips in its `<function=NAME>` calls, read as the calls it meant (KeyValueCalls'
`bare_calls` and `unclosed_values`):

- a call written without its `<tool_call>` opening (and often without `</tool_call>`): a call where the request offers
  a function of that name, words otherwise; a stream holds back a tail that may grow into such an opening;
- a value left without its `</parameter>`: it ends at the line that opens the next key or closes the call, rather
  than running on to a later `</parameter>` and swallowing that pair, while '<' inside a line stays in the value.

Every answer is read whole and streamed in 1-character, random and large pieces, which agree; what the client gets
is the arguments the template renders the call from (the `write`/`now` tools of test_tool_calls_xml). The grammars
write no such slip and accept nothing the parser would read otherwise.
"""

from __future__ import annotations

import json
import random

import pytest

from router_fake_agent import MODEL

from router.tool_calls import FORMATS, ToolCallStream
from tests.router.test_router_reasoning import _checkpoint, _client, _ids
from tests.router.test_tool_calls_xml import AS_JSON, CODER, SEED, TOOLS, WORDS, _call, _pairs
from tests.router.tool_call_checks import deltas_joined, grammar_accepts, grammar_compiler, read_chat_stream

NAMES = frozenset({"write", "now"})
NOW_CALL = "<function=now>\n<parameter=zone>\nutc\n</parameter>\n</function>"
NOW = ("now", {"zone": "utc"})


def _pieces(text: str, how) -> list[str]:
    if how == "random":
        rng, pieces, pos = random.Random(len(text)), [], 0
        while pos < len(text):
            size = rng.randint(1, 9)
            pieces.append(text[pos:pos + size])
            pos += size
        return pieces
    return [text[pos:pos + how] for pos in range(0, len(text), how)]


def _read(fmt_name: str, text: str) -> tuple[str, list[tuple[str, dict]]]:
    """(content, calls as (name, arguments)) of the whole answer, asserting that every stream of it agrees: the same
    content sent, the same calls returned, deltas that join into them."""
    fmt = FORMATS[fmt_name].with_tools(TOOLS)
    parsed = fmt.split(text, NAMES)
    content, calls = parsed if parsed is not None else (text, [])
    whole = (content, [(c.name, json.loads(c.arguments)) for c in calls])
    for how in (1, "random", len(text)):
        stream, sent, deltas = ToolCallStream(fmt, names=NAMES), "", []
        for piece in _pieces(text, how):
            sent += stream.add(piece)
            deltas += stream.take_deltas()
        tail, streamed = stream.finish()
        deltas += stream.take_deltas()
        assert (sent + tail, [(c.name, json.loads(c.arguments)) for c in streamed]) == whole, how
        assert deltas_joined(deltas) == [{"name": c.name, "arguments": c.arguments} for c in streamed], how
    return whole


# -- a call without its opening -----------------------------------------------------------------------


@pytest.mark.parametrize("text, calls, content", [
    (WORDS + NOW_CALL + "\n</tool_call>", [NOW], WORDS),
    (WORDS + NOW_CALL, [NOW], WORDS),
    (WORDS + NOW_CALL + "\n\nIt is noon there.", [NOW], WORDS + "It is noon there."),
    (NOW_CALL + "\n" + NOW_CALL.replace("utc", "local") + "\n</tool_call>", [NOW, ("now", {"zone": "local"})], ""),
    (NOW_CALL + "\n<tool_call>\n" + NOW_CALL + "\n</tool_call>", [NOW, NOW], ""),
    (WORDS + "<tool_call>\n" + NOW_CALL + "\n" + NOW_CALL + "\n</tool_call>", [NOW, NOW], WORDS),
], ids=["closed", "unclosed", "words after", "two", "then a whole call", "after a whole call"])
def test_a_call_without_its_opening_is_a_call(text, calls, content):
    assert _read("qwen3_coder", text) == (content, calls)


def test_a_seed_call_without_its_opening_is_a_call():
    call = "<function=now>\n<parameter=zone>utc</parameter>\n</function>"
    assert _read("seed_oss", WORDS + call + "\n</seed:tool_call>") == (WORDS, [NOW])


@pytest.mark.parametrize("words", [
    "Call it as <function=later>, not <function=nowhere>.",   # names no offered function
    "The tag <function=now is not closed here.",
    "Markup: <function=no",                                   # held back, then words after all
    "Markup: <func",
    "<function=later>\n<parameter=zone>\nutc\n</parameter>\n</function>",
])
def test_a_function_tag_that_opens_no_offered_call_is_words(words):
    assert _read("qwen3_coder", words + "\n" + NOW_CALL) == (words + "\n", [NOW])
    # after the calls, where the answer ends (right after a call, markup of a call not offered is left out, as it is
    # after the marker)
    after = "" if words.startswith("<function=later>") else words
    assert _read("qwen3_coder", NOW_CALL + "\n\n" + words) == (after, [NOW])


def test_a_stream_holds_back_only_what_may_open_an_offered_call():
    stream = ToolCallStream(FORMATS["qwen3_coder"].with_tools(TOOLS), names=NAMES)
    assert stream.add("See <function=") == "See "
    assert stream.add("later> or <function=wr") == "<function=later> or "
    assert stream.add("ong>") == "<function=wrong>"


# -- a value without its closing tag ------------------------------------------------------------------


CODE = 'if a < b:\n    print("<b>", a <b)\n    tag = "<parameter=x>" + "</function>"'


@pytest.mark.parametrize("fmt_name", ["qwen3_coder", "seed_oss"])
@pytest.mark.parametrize("unclosed", ["text", "zip", "text and zip"])
def test_a_value_without_its_closing_tag_ends_at_the_next_key_or_the_call_s_end(fmt_name, unclosed):
    """`text` is followed by another pair, `zip` is the last; each written without its `</parameter>`."""
    pairs = [("text", CODE), ("count", "3"), ("zip", "0150")]
    call = _call(fmt_name, "write", pairs)
    for key, value in pairs:
        if key in unclosed:
            layout = "\n" if fmt_name == "qwen3_coder" else ""
            call = call.replace(f"{value}{layout}</parameter>", f"{value}{layout}")
    assert call.count("</parameter>") == 3 - len(unclosed.split(" and "))
    assert _read(fmt_name, WORDS + call) == (WORDS, [("write", {"text": CODE, "count": 3, "zip": "0150"})])


@pytest.mark.parametrize("fmt_name, template", [("qwen3_coder", CODER), ("qwen3_coder", "Qwen-Qwen3-0.6B"),
                                                ("seed_oss", SEED)])
def test_the_grammars_write_no_slip_the_parser_would_read_otherwise(fmt_name, template, template_tokenizer):
    tokenizer, fmt = template_tokenizer(template), FORMATS[fmt_name]
    compiler = grammar_compiler(tokenizer, template)
    required, auto = fmt.grammar(TOOLS, True, tokenizer), fmt.auto_grammar(TOOLS, True, tokenizer)
    begin, end = ("<tool_call>\n", "\n</tool_call>") if fmt_name == "qwen3_coder" else ("<seed:tool_call>\n",
                                                                                          "\n</seed:tool_call>")
    # a string value may hold '<' and tags inside its lines, which read back as written (`</function>` is a special
    # token of these templates' vocabularies, which text cannot hold)
    code = CODE.replace(' + "</function>"', "")
    call = _call(fmt_name, "write", _pairs(fmt_name, **AS_JSON, text=code))
    assert grammar_accepts(compiler, tokenizer, required, call)
    assert json.loads(fmt.with_tools(TOOLS).split(call, NAMES)[1][0].arguments)["text"] == code
    # but no line the parser would take for the next key or the call's end
    for line in ("<parameter=zip>", "</function>"):
        for text in (f"a\n{line}\nb", f"{line}\nb"):
            call = _call(fmt_name, "write", _pairs(fmt_name, **AS_JSON, text=text))
            accepted = grammar_accepts(compiler, tokenizer, required, call)
            assert not accepted or json.loads(fmt.with_tools(TOOLS).split(call, NAMES)[1][0].arguments)["text"] == text
            if text.startswith("a"):
                assert not accepted, text
    # under auto with a strict tool, words never open a call the grammar did not shape
    bare = NOW_CALL if fmt_name == "qwen3_coder" else NOW_CALL.replace(">\nutc\n<", ">utc<")
    free = bare.replace("</parameter>", "").replace("</function>", "")  # no special token: words could hold it
    assert not grammar_accepts(compiler, tokenizer, auto, WORDS + free)
    assert grammar_accepts(compiler, tokenizer, auto, WORDS + free.replace("=now", "=later"))
    assert grammar_accepts(compiler, tokenizer, auto, WORDS + begin + bare + end)


async def test_a_site_s_slipped_call_reaches_the_openai_client(cluster, make_router, tmp_path):
    """A scripted Qwen3-Coder site writes words and a call with neither `<tool_call>` nor `</tool_call>`, one value
    left unclosed: the official client gets the call, streamed and whole alike, and the words as content."""
    info, hf = _checkpoint(tmp_path / "coder", CODER)
    info.context_length = 4096  # the tool list in Qwen3-Coder's system prompt takes most of the default 1024
    call = _call("qwen3_coder", "write", [("text", CODE), ("count", "3")]).replace(f"{CODE}\n</parameter>", CODE)
    call = call[call.index("<function="):call.index("\n</tool_call>")]
    _agents, client = await _client(cluster, make_router, info, _ids(hf, WORDS + call))
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Note it."}], tools=TOOLS, max_tokens=400)
    async with client:
        whole = (await client.chat.completions.create(**body)).choices[0]
        assert (whole.finish_reason, whole.message.content) == ("tool_calls", WORDS)
        (read,) = whole.message.tool_calls
        assert (read.function.name, json.loads(read.function.arguments)) == ("write", {"text": CODE, "count": 3})
        streamed, _thought, content, finish, _num_chunks = await read_chat_stream(client, body)
        assert (streamed, content, finish) == ([(read.function.name, read.function.arguments)], WORDS, "tool_calls")
        # Stop strings end words: the arguments' `print` and the call's own `</function>` do not cut the call.
        stopped = dict(body, stop=["print", "</function>"])
        choice = (await client.chat.completions.create(**stopped)).choices[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", WORDS)
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
            (read.function.name, read.function.arguments)]
        assert (await read_chat_stream(client, stopped))[:4] == (streamed, _thought, WORDS, "tool_calls")
