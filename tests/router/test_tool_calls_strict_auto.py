"""`strict` function tools under `tool_choice: auto`: the model may answer in words or call a tool, and a
call it makes follows the function's schema (OpenAI's guarantee for strict tools; the Agents SDK sends
`strict: true` with `auto` by default).

Grammar level, for every recognised tool-call format: the `auto` grammar accepts plain text, text then
calls (where the format has a marker), and refuses arguments against a strict schema, unknown names, a
second call without `parallel_tool_calls`, and the marker in text without a call after it.
Served, through the official `openai` client, on a random-weight checkpoint with Qwen2.5's template
(Hermes calls) whose free output is noise: with a strict tool every call it writes validates and
answers without one come back as text; without `strict` the same requests run free, as before.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from tokenizers import AddedToken, Tokenizer

from engine.grammar import GrammarCompiler
from engine.tokenizer import ChatTokenizer
from router.completions import request_grammar
from router.errors import ApiError
from router.model_assets import ModelAssets
from router.openai_request import parse_request
from router.reasoning import reasoning_first, reasoning_format
from router.tool_calls import FORMATS, tool_call_format
from tests.engine.chat_checkpoints import CONTROL_TOKEN, template_text, train_tokenizer
from tests.router.test_router_structured import MODEL, model_dir, serving  # noqa: F401 (fixture)
from tests.router.test_router_tool_calls import CALL_TEXT, EXPECTED

ADD = {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
# Not strict: its arguments may be any JSON object.
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (ADD, WEATHER)}
QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _loose(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool["function"].items() if k != "strict"}}


def _accepts(tokenizer: ChatTokenizer, spec, text: str) -> bool:
    compiler = GrammarCompiler(tokenizer.tokenizer.to_str(), tokenizer.vocab_size,
                               [tokenizer.token_to_id(tokenizer.eos_token)], num_threads=1)
    matcher = compiler.matcher(spec)
    return all(matcher.consume(t) for t in tokenizer.encode(text, add_special_tokens=False)) and \
        matcher.matcher.is_accepting()


@pytest.mark.parametrize("name", sorted(CALL_TEXT))
def test_auto_grammar_allows_text_or_calls_that_follow_the_strict_schema(name, template_tokenizer):
    tokenizer = template_tokenizer(next(t for t, f in EXPECTED.items() if f == name))
    fmt = FORMATS[name]
    spec = fmt.auto_grammar([ADD, NOTE], True, tokenizer)
    call = CALL_TEXT[name]
    prefix = "Let me add them. " if fmt.marker else ""
    assert _accepts(tokenizer, spec, "The answer is 3, no tool needed.")
    assert _accepts(tokenizer, spec, "")
    assert _accepts(tokenizer, spec, prefix + call)
    # the strict schema holds: a string for an integer, a number out of range, an unknown key
    assert not _accepts(tokenizer, spec, prefix + call.replace('"a": 1', '"a": "one"'))
    assert not _accepts(tokenizer, spec, prefix + call.replace('"a": 1', '"a": 100'))
    assert not _accepts(tokenizer, spec, prefix + call.replace('"a": 1', '"c": 0, "a": 1'))
    # only offered functions; a non-strict one takes any object
    assert not _accepts(tokenizer, spec, prefix + call.replace("add", "sub"))
    assert _accepts(tokenizer, spec, prefix + call.replace("add", "note").replace('"a": 1, "b": 2', '"x": [true]'))
    if fmt.marker:  # the marker's text cannot appear in words that a call does not follow
        assert not _accepts(tokenizer, spec, f"Words {fmt.marker.strip()} more words")
    # without parallel_tool_calls a second call is refused; with it, where the format can, it is taken
    if fmt.parallel:
        two = _two_calls(fmt, call)
        assert _accepts(tokenizer, spec, prefix + two)
        assert not _accepts(tokenizer, fmt.auto_grammar([ADD, NOTE], False, tokenizer), prefix + two)


def _two_calls(fmt, call: str) -> str:
    """The format's text of two calls of `add`."""
    if fmt.array:
        item = call[call.index("[{") + 1:call.rindex("}]") + 1]
        return call.replace(item, f"{item}, {item}")
    if fmt.section_begin:
        inner = call[len(fmt.section_begin):len(call) - len(fmt.section_end)]
        return fmt.section_begin + inner + fmt.separator + inner + fmt.section_end
    return call + fmt.separator + call


def test_a_marker_in_plain_text_opens_calls_lazily(tmp_path):
    """Hermes calls on a tokenizer without a `<tool_call>` token: the marker is text, found as it is written."""
    control = sorted(set(CONTROL_TOKEN.findall(template_text("Qwen-Qwen2.5-7B-Instruct"))) - {"<tool_call>"})
    train_tokenizer(control).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tokenizer = ChatTokenizer.from_dir(tmp_path)
    assert tokenizer.token_to_id("<tool_call>") is None
    fmt = FORMATS["hermes"]
    spec = fmt.auto_grammar([ADD], False, tokenizer)
    assert _accepts(tokenizer, spec, "Sure. " + CALL_TEXT["hermes"])
    assert _accepts(tokenizer, spec, "Just words, and a <tool_ that never closes.")
    assert not _accepts(tokenizer, spec, "Sure. " + CALL_TEXT["hermes"].replace('"a": 1', '"a": 1.5'))
    assert not _accepts(tokenizer, spec, "Words <tool_call> more words")


def test_an_added_marker_not_flagged_special_is_matched_as_its_token(tmp_path):
    """Qwen's tokenizer adds `<tool_call>` without flagging it special; the grammar library still reads it as a
    special token, so a grammar must name it by id: else the model's own token is refused (and the marker
    could only be spelt out byte by byte), in a required call as much as under `auto`."""
    control = sorted(set(CONTROL_TOKEN.findall(template_text("Qwen-Qwen2.5-7B-Instruct"))) - {"<tool_call>"})
    trained = train_tokenizer(control)
    trained.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    trained.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tokenizer = ChatTokenizer.from_dir(tmp_path)
    marker_id = tokenizer.token_to_id("<tool_call>")
    assert marker_id in tokenizer.encode(CALL_TEXT["hermes"], add_special_tokens=False)
    fmt = FORMATS["hermes"]
    assert _accepts(tokenizer, fmt.grammar([ADD], False, tokenizer), CALL_TEXT["hermes"])
    assert _accepts(tokenizer, fmt.auto_grammar([ADD], False, tokenizer), "Sure. " + CALL_TEXT["hermes"])


def test_a_model_that_opens_its_own_reasoning_may_think_first(template_tokenizer):
    """Qwen3 writes `<think>` itself: the reasoning block is free, then the answer is text or strict calls."""
    tokenizer = template_tokenizer("Qwen-Qwen3-0.6B")
    reasoning = reasoning_format(tokenizer)
    spec = reasoning_first(tool_call_format(tokenizer).auto_grammar([ADD], True, tokenizer), reasoning.start_id,
                           reasoning.end_id)
    thought = "<think>\nThe user wants a sum; I have a tool for that.\n</think>\n\n"
    assert _accepts(tokenizer, spec, thought + CALL_TEXT["hermes"])
    assert _accepts(tokenizer, spec, thought + "It is 3.")
    assert _accepts(tokenizer, spec, "It is 3.")
    assert not _accepts(tokenizer, spec, thought + CALL_TEXT["hermes"].replace('"b": 2', '"b": -2'))


def test_only_strict_tools_under_auto_get_a_grammar(template_tokenizer):
    tokenizer = template_tokenizer("Qwen-Qwen2.5-7B-Instruct")
    assets = ModelAssets(model=MODEL, tokenizer=tokenizer, context_length=4096, eos_token_ids=[0], block_size=16,
                         kv_bytes_per_token=1, generation_config={}, tool_calls=tool_call_format(tokenizer))

    def grammar(**body):
        return request_grammar(parse_request({"model": MODEL, "messages": QUESTION, **body}, chat=True), assets)

    assert grammar(tools=[_loose(ADD), NOTE]) is None  # no strict tool: free, as before
    assert grammar(tools=[ADD, NOTE], tool_choice="none") is None
    assert grammar(tools=[ADD, NOTE]).kind == "lark"
    assert grammar(tools=[ADD, NOTE], tool_choice="auto") == grammar(tools=[ADD, NOTE])
    # a strict schema the grammar library refuses is a 400 naming it; `strict` must be a boolean
    bad = {"type": "function", "function": {"name": "f", "strict": True,
                                            "parameters": {"type": "object", "oneOf": [{}, {}]}}}
    with pytest.raises(ApiError) as refused:
        grammar(tools=[bad])
    assert refused.value.param == "tools[0].function.parameters"
    assert grammar(tools=[_loose(bad)]) is None  # not strict: not enforced, so not refused
    with pytest.raises(ApiError) as not_bool:
        grammar(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}])
    assert not_bool.value.param == "tools[0].function.strict"


async def test_strict_auto_calls_validate_and_text_stays_text(cluster, make_router, model_dir):  # noqa: F811
    """Noise sampled at temperature 1, nudged towards `<tool_call>` and the end of the turn (logit_bias) so
    that some answers call and some do not: with strict tools every call validates;
    without, the same calls are mostly noise."""
    async with serving(cluster, make_router, model_dir, MODEL) as (client, engine):
        vocab = Tokenizer.from_file(str(engine.model_dir / "tokenizer.json"))
        # as likely to open a call as to end the answer, so both kinds of answer come up
        nudge = {str(vocab.token_to_id("<tool_call>")): 3, str(vocab.token_to_id("<|im_end|>")): 3}

        async def answer(tools: list[dict], seed: int):
            completion = await client.chat.completions.create(
                model=MODEL, messages=QUESTION, tools=tools, seed=seed, temperature=1.0, max_tokens=160,
                parallel_tool_calls=False, logit_bias=nudge)
            return completion.choices[0]

        seeds = range(16)
        strict = await asyncio.gather(*(answer([WEATHER, ADD], seed) for seed in seeds))
        loose = await asyncio.gather(*(answer([_loose(WEATHER), _loose(ADD)], seed) for seed in seeds))
    num_calls = num_text = 0
    for choice in strict:
        if choice.message.tool_calls:
            num_calls += 1
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
            call = choice.message.tool_calls[0]
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
        elif choice.finish_reason == "stop":  # an answer in words, which the marker never enters
            num_text += 1
            assert isinstance(choice.message.content, str) and "<tool_call>" not in choice.message.content
        else:  # cut by max_tokens, in words or in a call not yet closed (content, as OpenAI's "length")
            assert choice.finish_reason == "length"
    assert num_calls >= 3 and num_text >= 3, (num_calls, num_text)
    # without strict the model writes freely: markers followed by noise that is no call come back as content
    assert any("<tool_call>" in (c.message.content or "") and not c.message.tool_calls for c in loose)
