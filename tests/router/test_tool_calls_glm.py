"""GLM-4.5 / GLM-4.6 tool calls (format `glm45`): `<tool_call>NAME`, a `<arg_key>`/`<arg_value>` pair per
argument, `</tool_call>`, against the published templates (tests/engine/chat_templates, zai-org-GLM-4.5/4.6).

The format is recognised from GLM's templates and not from Qwen's or Hermes' (which write `<tool_call>` too);
calls parse, whole and streamed, into OpenAI calls whose arguments are the JSON object built from the pairs (a
string as written, other values as JSON, by the function's schema); the grammars of a required, named or strict
call accept exactly well-formed calls following the schema, and what they let a model write parses and
validates; a conversation with calls and results renders through the real template and its calls read back;
and through the router with the official `openai` client, a scripted GLM site's calls (after its reasoning)
stream as OpenAI's.
"""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from router_fake_agent import MODEL

from router.reasoning import reasoning_format
from router.tool_calls import FORMATS, ToolCallStream, tool_call_format
from tests.engine.chat_checkpoints import TEMPLATES
from tests.router.test_router_reasoning import _checkpoint, _client, _ids
from tests.router.tool_call_checks import (deltas_joined, grammar_accepts, grammar_compiler, read_chat_stream,
                                          replayed_conversation, stream_in_pieces)

GLM = ("zai-org-GLM-4.5", "zai-org-GLM-4.6")
WRITE = {"type": "function", "function": {"name": "write", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["text", "count", "options", "zip"],
    "properties": {
        "text": {"type": "string"}, "count": {"type": "integer"},
        "options": {"type": "object", "additionalProperties": False, "required": ["tags", "draft"],
                    "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                   "draft": {"type": "boolean"}}},
        "zip": {"type": "string"}}}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}}}}
TOOLS = [WRITE, NOW]
NAMES = frozenset({"write", "now"})
ARGUMENTS = [{"text": 'line one\nshe said "hi"', "count": 3, "options": {"tags": ["a", "b"], "draft": False},
              "zip": "0150"},
             {"zone": "utc"}]
# Two calls as GLM-4.6 writes them (its template's shape for replayed calls, and its system prompt's): a string
# as written, the rest as JSON.
CALLS = ('<tool_call>write\n<arg_key>text</arg_key>\n<arg_value>line one\nshe said "hi"</arg_value>\n'
         '<arg_key>count</arg_key>\n<arg_value>3</arg_value>\n'
         '<arg_key>options</arg_key>\n<arg_value>{"tags": ["a", "b"], "draft": false}</arg_value>\n'
         '<arg_key>zip</arg_key>\n<arg_value>0150</arg_value>\n</tool_call>\n'
         '<tool_call>now\n<arg_key>zone</arg_key>\n<arg_value>utc</arg_value>\n</tool_call>')
WORDS = "I will write it down.\n"


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_glm_templates_and_only_they_are_the_key_value_format(template, template_tokenizer):
    tokenizer = template_tokenizer(template)
    fmt = tool_call_format(tokenizer)
    if template in GLM:
        assert fmt.name == "glm45" and reasoning_format(tokenizer).name == "think"
    else:  # Qwen's and Hermes' `<tool_call>` stays theirs, and no other template is taken
        assert fmt is None or fmt.name != "glm45"
    if template in ("Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use"):
        assert fmt.name == "hermes"


@pytest.mark.parametrize("step", [1, 5, 23])
def test_two_calls_parse_to_openai_calls_whole_and_streamed(step):
    fmt = FORMATS["glm45"].with_tools(TOOLS)
    text = WORDS + CALLS
    content, calls = fmt.split(text, NAMES)
    assert content == WORDS
    assert [(c.name, json.loads(c.arguments)) for c in calls] == list(zip(["write", "now"], ARGUMENTS))
    words, streamed, deltas, joined = stream_in_pieces(fmt, NAMES, text, step)
    name_sent_at = next((end for end, so_far in joined if so_far), None)
    first_pair_sent_at = next((end for end, so_far in joined if so_far and so_far[0]["arguments"]), None)
    assert words == WORDS
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    assert deltas_joined(deltas) == [{"name": c.name, "arguments": c.arguments} for c in calls]
    # the name goes out once its line ends, each pair once its value closes, long before the call closes
    assert name_sent_at - step < text.index("write\n") + len("write\n") <= name_sent_at
    first_value_end = text.index("</arg_value>") + len("</arg_value>")
    assert first_pair_sent_at - step < first_value_end <= first_pair_sent_at


def test_values_follow_the_schema_and_without_one_json_where_it_parses():
    text = CALLS.split("\n<tool_call>now")[0]
    with_schema = FORMATS["glm45"].with_tools(TOOLS).split(text)[1][0]
    assert json.loads(with_schema.arguments)["zip"] == "0150"  # a string property: the text as written
    without = json.loads(FORMATS["glm45"].split(text)[1][0].arguments)
    assert without["count"] == 3 and without["options"] == ARGUMENTS[0]["options"]
    assert without["text"] == ARGUMENTS[0]["text"] and without["zip"] == "0150"  # not JSON: a string


def test_a_call_cut_short_keeps_the_pairs_written_and_broken_markup_is_no_call():
    fmt = FORMATS["glm45"].with_tools(TOOLS)
    cut = CALLS[:CALLS.index("<arg_key>options")]
    _content, (call,) = fmt.split(cut, NAMES, cut=True)
    assert call.arguments == '{"text": "line one\\nshe said \\"hi\\"", "count": 3'
    broken = "See <tool_call>write\n<arg_value>3</arg_value>\n</tool_call>"  # a value without its key
    assert fmt.split(broken, NAMES) is None


# -- grammars ------------------------------------------------------------------------------------------


WRONG = {
    "a string for an integer": CALLS.replace("<arg_value>3<", "<arg_value>three<"),
    "a nested value of the wrong type": CALLS.replace('"draft": false', '"draft": "no"'),
    "a required key left out": CALLS.replace("<arg_key>count</arg_key>\n<arg_value>3</arg_value>\n", ""),
    "a key the schema does not have": CALLS.replace("<arg_key>zip</arg_key>", "<arg_key>postcode</arg_key>"),
    "keys out of the schema's order": CALLS.replace("<arg_key>text</arg_key>\n<arg_value>line one\nshe said \"hi\""
                                                    "</arg_value>\n<arg_key>count</arg_key>\n<arg_value>3</arg_value>",
                                                    "<arg_key>count</arg_key>\n<arg_value>3</arg_value>\n<arg_key>text"
                                                    "</arg_key>\n<arg_value>line one\nshe said \"hi\"</arg_value>"),
    "a value outside the enum of now": CALLS.replace(">utc<", ">mars<"),
    "a function not offered": CALLS.replace("<tool_call>now", "<tool_call>later"),
    "JSON arguments (Hermes' shape)": '<tool_call>\n{"name": "now", "arguments": {"zone": "utc"}}\n</tool_call>',
    "a string value holding the closing tag": CALLS.replace("line one", "line </arg_value> one"),
}


@pytest.mark.parametrize("template", [*GLM, "Qwen-Qwen3-0.6B"])  # Qwen3's vocabulary: the tags are plain text
def test_required_named_and_strict_grammars_accept_exactly_well_formed_calls(template, template_tokenizer):
    tokenizer = template_tokenizer(template)
    compiler, fmt = grammar_compiler(tokenizer, template), FORMATS["glm45"]
    first, second = CALLS.split("\n<tool_call>now")
    second = "<tool_call>now" + second
    required, single = fmt.grammar(TOOLS, True, tokenizer), fmt.grammar(TOOLS, False, tokenizer)
    named = fmt.grammar([NOW], False, tokenizer)
    auto = fmt.auto_grammar(TOOLS, True, tokenizer)  # `write` is strict
    for spec, text in ((required, CALLS), (required, first), (single, second), (named, second),
                       (auto, WORDS + CALLS), (auto, "Just words, no call."),
                       (required, first.replace("line one\nshe said \"hi\"", "")),
                       (named, "<tool_call>now\n</tool_call>")):  # an empty string; an optional key left out
        assert grammar_accepts(compiler, tokenizer, spec, text), text
    assert not grammar_accepts(compiler, tokenizer, single, CALLS)  # parallel_tool_calls false: one call
    assert not grammar_accepts(compiler, tokenizer, named, first)   # a named call: that function only
    for what, text in WRONG.items():
        assert not grammar_accepts(compiler, tokenizer, required, text), what
        if "now" not in what:  # under auto only the strict function's arguments follow its schema
            assert not grammar_accepts(compiler, tokenizer, auto, WORDS + text), what


def test_what_the_grammar_lets_a_model_write_parses_and_follows_the_schema(template_tokenizer):
    """A random walk through the required-call grammar's token masks (the engine's masks, tokens drawn at
    random, the template's tags and the end favoured so a walk ends): every output parses into calls whose
    arguments validate."""
    template = "zai-org-GLM-4.6"
    tokenizer = template_tokenizer(template)
    compiler, fmt = grammar_compiler(tokenizer, template), FORMATS["glm45"].with_tools(TOOLS)
    spec = fmt.grammar(TOOLS, True, tokenizer)
    eos = tokenizer.token_to_id(TEMPLATES[template][1])
    tags = {tokenizer.token_to_id(t) for t in ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                                               "<arg_value>", "</arg_value>")}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    num_calls = 0
    for seed in range(12):
        rng, matcher, ids = random.Random(seed), compiler.matcher(spec), []
        while len(ids) < 400:
            mask = compiler.fill_masks([matcher])[0].view(np.uint32)
            allowed = [t for t in range(tokenizer.vocab_size) if mask[t // 32] >> (t % 32) & 1]
            if eos in allowed and (len(allowed) == 1 or rng.random() < 0.5):
                break
            favoured = [t for t in allowed if t in tags] if rng.random() < 0.3 else []
            token = rng.choice(favoured or allowed)
            assert matcher.consume(token)
            ids.append(token)
        else:
            continue  # a walk that wandered (a long number): nothing to check
        text = tokenizer.decode(ids, skip_special_tokens=False)
        stream = ToolCallStream(fmt, forced=True, names=NAMES)
        content = stream.add(text)
        tail, calls = stream.finish()
        assert content + tail == "" and calls, text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        num_calls += len(calls)
    assert num_calls >= 6


# -- the real templates ------------------------------------------------------------------------------


@pytest.mark.parametrize("template", GLM)
def test_a_replayed_conversation_renders_through_the_template_and_its_calls_read_back(template,
                                                                                      template_tokenizer):
    rendered = replayed_conversation(template_tokenizer(template), TOOLS, ARGUMENTS)
    turn = rendered[rendered.index("<|assistant|>"):rendered.index("<|observation|>")]
    assert '<arg_value>line one\nshe said "hi"</arg_value>' in turn and "<arg_value>0150</arg_value>" in turn
    _content, read = FORMATS["glm45"].with_tools(TOOLS).split(turn, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in read] == list(zip(["write", "now"], ARGUMENTS))
    assert rendered.index("written") < rendered.index("12:00") < len(rendered) - len("<|assistant|>")


# -- through the router --------------------------------------------------------------------------------


async def test_a_glm_site_s_reasoning_and_calls_reach_the_openai_client(cluster, make_router, tmp_path):
    """GLM-4.6's template on a scripted site writing `\\n<think>...</think>\\n` and two calls: the client gets the
    reasoning apart and the calls as OpenAI's, streamed and whole the same; replayed with their results, the
    calls reach the site's prompt as the template writes them."""
    info, hf = _checkpoint(tmp_path / "glm", "zai-org-GLM-4.6")
    script = _ids(hf, "\n<think>Two tools to call.</think>\n" + CALLS)
    agents, client = await _client(cluster, make_router, info, script)
    messages = [{"role": "user", "content": "Note it, and the time."}]
    async with client:
        for tool_choice in ("auto", "required"):
            body = dict(model=MODEL, messages=messages, tools=TOOLS, tool_choice=tool_choice, max_tokens=300)
            whole = (await client.chat.completions.create(**body)).choices[0]
            assert whole.finish_reason == "tool_calls" and not whole.message.content
            assert whole.message.model_extra["reasoning_content"] == "Two tools to call."
            assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == \
                list(zip(["write", "now"], ARGUMENTS))
            streamed, reasoning, content, finish, num_argument_chunks = await read_chat_stream(client, body)
            assert reasoning == "Two tools to call." and not content and finish == "tool_calls"
            assert streamed == [(c.function.name, c.function.arguments)
                                               for c in whole.message.tool_calls]
            assert num_argument_chunks >= 5  # a piece per pair, not one at the end
        replay = messages + [whole.message.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": c.id, "content": "done"} for c in whole.message.tool_calls]
        await client.chat.completions.create(model=MODEL, messages=replay, tools=TOOLS, max_tokens=8)
        _method, request = agents[0].calls[-1]
        prompt = hf.decode(list(request.prompt_ids))
        assert CALLS in prompt and prompt.endswith("</tool_response><|assistant|>")
