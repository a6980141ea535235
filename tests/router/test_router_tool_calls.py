"""Tool-call formats against the published chat templates (tests/engine/chat_templates).

For every template that shows a tool-call format: the format is recognised from the template alone;
a call the template itself renders (an assistant turn replayed with `tool_calls`) parses back to the
same function and arguments; the grammar of a required call accepts exactly that format's text, with
the template's control tokens matched as tokens; and the streamed split gives the same content and
calls as the whole text.
"""

from __future__ import annotations

import json

import pytest

from engine.grammar import GrammarCompiler
from router.tool_calls import FORMATS, ToolCallStream, tool_call_format
from tests.engine.chat_checkpoints import TEMPLATES

EXPECTED = {
    "Qwen-Qwen2.5-7B-Instruct": "hermes", "Qwen-Qwen3-0.6B": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3_json", "meta-llama-Llama-3.2-3B-Instruct": "llama3_json",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral", "Mistral-Small-3.2-24B-Instruct-2506": "mistral_v11",
    "ibm-granite-granite-3.3-2B-Instruct": "granite", "CohereForAI-c4ai-command-r7b-12-2024-tool_use": "command_r7b",
    "deepseek-ai-DeepSeek-V3.1": "deepseek_v3", "Kimi-K2-Thinking": "kimi_k2", "openai-gpt-oss-120b": "harmony",
    "zai-org-GLM-4.5": "glm45", "zai-org-GLM-4.6": "glm45",
    "Qwen-Qwen3-Coder-30B-A3B-Instruct": "qwen3_coder", "ByteDance-Seed-Seed-OSS-36B-Instruct": "seed_oss",
}
# Templates that cannot show a call of their own: Granite's drops assistant tool calls from the prompt,
# Kimi K2's builds its tool-call turn with list.append, which the sandbox refuses (transformers' too); gpt-oss's
# calls are harmony messages, which the reasoning split turns into this format's text
# (tests/router/test_router_harmony.py).
NOT_RENDERED = ("ibm-granite-granite-3.3-2B-Instruct", "Kimi-K2-Thinking", "openai-gpt-oss-120b")
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}
CITY = {"type": "function", "function": {"name": "city_time", "description": "the time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# One call as each format writes it (what the grammar of a required call must accept).
CALL_TEXT = {
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
    "mistral_v11": '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
    "granite": '<|tool_call|>[{"name": "add", "arguments": {"a": 1, "b": 2}}]',
    "command_r7b": '<|START_ACTION|>[{"tool_name": "add", "parameters": {"a": 1, "b": 2}}]<|END_ACTION|>',
    "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1, "b": 2}<｜tool▁call▁end｜>'
                   '<｜tool▁calls▁end｜>',
    "kimi_k2": '<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>'
               '{"a": 1, "b": 2}<|tool_call_end|><|tool_calls_section_end|>',
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_format_is_recognised_from_the_template_and_its_own_calls_parse_back(name, template_tokenizer):
    tokenizer = template_tokenizer(name)
    fmt = tool_call_format(tokenizer)
    assert (fmt.name if fmt else None) == EXPECTED.get(name)
    if fmt is None or name in NOT_RENDERED or fmt.name not in CALL_TEXT:
        return  # (key/value calls, not JSON: tests/router/test_tool_calls_glm.py, test_tool_calls_xml.py)
    parsed = fmt.split(CALL_TEXT[fmt.name])[1][0]
    call = {"id": parsed.id, "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [{"role": "user", "content": "add 1 and 2"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": parsed.id, "content": "3"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=[ADD])
    answer = rendered[rendered.rindex("add 1 and 2") + len("add 1 and 2"):]
    if not fmt.marker:  # a bare JSON call: the assistant's turn is the JSON
        answer = answer[answer.index("{"):]
    parsed_back = fmt.split(answer)
    assert parsed_back is not None, answer
    content, calls = parsed_back
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("name", sorted(CALL_TEXT))
def test_required_call_grammar_accepts_the_format_and_nothing_else(name, template_tokenizer):
    template = next(t for t, f in EXPECTED.items() if f == name)
    tokenizer = template_tokenizer(template)
    fmt = FORMATS[name]
    compiler = GrammarCompiler(tokenizer.tokenizer.to_str(), tokenizer.vocab_size,
                               [tokenizer.token_to_id(TEMPLATES[template][1])])
    text = CALL_TEXT[name]
    for parallel in (False, True):
        matcher = compiler.matcher(fmt.grammar([ADD, CITY], parallel, tokenizer))
        assert all(matcher.consume(t) for t in tokenizer.encode(text, add_special_tokens=False)), name
        assert matcher.matcher.is_accepting()
    wrong = text.replace('"a": 1', '"a": "one"')
    matcher = compiler.matcher(fmt.grammar([ADD], False, tokenizer))
    assert not all(matcher.consume(t) for t in tokenizer.encode(wrong, add_special_tokens=False))


@pytest.mark.parametrize("name", sorted(CALL_TEXT))
def test_streamed_split_equals_the_whole_text_split(name):
    fmt = FORMATS[name]
    prefix = "" if not fmt.marker else "Let me check. "
    text = prefix + CALL_TEXT[name]
    whole = fmt.split(text)
    assert whole is not None and whole[0] == prefix and [c.name for c in whole[1]] == ["add"]
    stream, sent = ToolCallStream(fmt), ""
    for i in range(0, len(text), 3):
        sent += stream.add(text[i:i + 3])
    tail, calls = stream.finish()
    assert sent + tail == prefix
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole[1]]
    # no call in the text: everything is content, and it all comes out
    plain = ToolCallStream(fmt)
    out = plain.add("Just words [TOOL") + plain.add("S] and <tool") + plain.add(" more")
    assert out + plain.finish()[0] == "Just words [TOOLS] and <tool more" and not plain.finish()[1]


def test_calls_that_do_not_parse_stay_content():
    fmt = FORMATS["hermes"]
    broken = 'Sure <tool_call>\n{"name": "add", "arguments": {"a": 1,'
    stream = ToolCallStream(fmt)
    assert stream.add(broken) == "Sure "
    assert stream.finish() == (broken[len("Sure "):], [])


# A linked list: `$defs` for the item, "#" for the rest of the list (the parameters themselves).
LINKED = {"type": "function", "function": {"name": "push", "description": "a list", "parameters": {
    "$defs": {"item": {"type": "integer"}}, "type": "object",
    "properties": {"head": {"$ref": "#/$defs/item"}, "tail": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["head", "tail"], "additionalProperties": False}}}


@pytest.mark.parametrize("name", sorted(CALL_TEXT))
def test_required_call_grammar_resolves_refs_within_the_parameters(name, template_tokenizer):
    """`$ref`s in a function's parameters point into the parameters, not into the call the grammar wraps
    them in: the grammar compiles, takes arguments that follow the parameters, and refuses a nested call."""
    template = next(t for t, f in EXPECTED.items() if f == name)
    tokenizer = template_tokenizer(template)
    compiler = GrammarCompiler(tokenizer.tokenizer.to_str(), tokenizer.vocab_size,
                               [tokenizer.token_to_id(TEMPLATES[template][1])])
    args = '{"a": 1, "b": 2}'
    good = CALL_TEXT[name].replace('"add"', '"push"').replace("add", "push").replace(
        args, '{"head": 1, "tail": {"head": 2, "tail": null}}')
    bad = good.replace('{"head": 2, "tail": null}', '{"name": "push", "arguments": {"head": 2, "tail": null}}')
    for parallel in (False, True):
        matcher = compiler.matcher(FORMATS[name].grammar([LINKED, ADD], parallel, tokenizer))
        assert all(matcher.consume(t) for t in tokenizer.encode(good, add_special_tokens=False)), good
        assert matcher.matcher.is_accepting()
        matcher = compiler.matcher(FORMATS[name].grammar([LINKED, ADD], parallel, tokenizer))
        assert not all(matcher.consume(t) for t in tokenizer.encode(bad, add_special_tokens=False)), bad


def test_parallel_tool_calls_false_keeps_only_the_first_call_a_free_model_writes():
    """`parallel_tool_calls: false` promises at most one call; under `auto` the model is not constrained and
    may write two, of which the answer carries the first (streamed or whole, the same)."""
    fmt = FORMATS["hermes"]
    text = CALL_TEXT["hermes"] + "\n" + CALL_TEXT["hermes"].replace('"a": 1', '"a": 5')
    for parallel, expected in ((True, [1, 5]), (False, [1])):
        stream = ToolCallStream(fmt, parallel=parallel)
        sent = "".join(stream.add(text[i:i + 4]) for i in range(0, len(text), 4))
        tail, calls = stream.finish()
        assert sent + tail == ""
        assert [json.loads(c.arguments)["a"] for c in calls] == expected
