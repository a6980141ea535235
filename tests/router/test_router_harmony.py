"""gpt-oss's harmony messages through the router, with the official `openai` client: the analysis channel is
`reasoning_content`, the final channel `content`, a commentary message to `functions.NAME` a tool call (finish
reason "tool_calls"), a preamble (commentary to no one) content; no header or end token is ever text. Streamed
and whole alike, cut by max_tokens as the other formats are; the grammars of a required call, a response format
and strict tools accept what gpt-oss writes; an earlier turn's reasoning, call and tool result reach the model as
transformers renders them.

The site is a fake agent playing a scripted token sequence, of a tokenizer that has harmony's special tokens and
the stored gpt-oss template."""

from __future__ import annotations

import json

import openai
import pytest
from router_fake_agent import MODEL, model_info_from_dir

from engine.grammar import GrammarCompiler, GrammarSpec
from engine.tokenizer import ChatTokenizer
from tests.engine.chat_checkpoints import CONTROL_TOKEN, template_text, train_tokenizer, write_template_tokenizer
from tests.router.test_router_reasoning import ScriptedAgent

TEMPLATE = "openai-gpt-oss-120b"
ADD = {"type": "function", "function": {"name": "add", "description": "Adds two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CITY = {"type": "function", "function": {"name": "city_time", "description": "The time in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [ADD, CITY]
ARGS = '{"a": 1, "b": 2}'
USER = [{"role": "user", "content": "Add 1 and 2."}]
THOUGHT = "The user wants a sum. I can add them with the tool."
ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant"
CALL = f"<|channel|>commentary to=functions.add <|constrain|>json<|message|>{ARGS}<|call|>"


def _checkpoint(directory):
    """The stored template's tokenizer, with `<|constrain|>` (gpt-oss writes it; the template does not), and
    gpt-oss's ends of sequence: `<|return|>` and `<|call|>`."""
    from transformers import AutoTokenizer

    write_template_tokenizer(directory, TEMPLATE)
    control = sorted(set(CONTROL_TOKEN.findall(template_text(TEMPLATE))) | {"<|constrain|>"})
    train_tokenizer(control).save(str(directory / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(directory))
    ends = [hf.convert_tokens_to_ids(token) for token in ("<|return|>", "<|call|>")]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    info = model_info_from_dir(directory)
    info.chat_template = (directory / "chat_template.jinja").read_text()
    return info, hf


@pytest.fixture
async def harmony(cluster, make_router, tmp_path):
    """(openai client, play(text) -> its token ids, hf tokenizer, agent): the site writes `text` as gpt-oss
    would, ending the output at its last token when that is `<|return|>` or `<|call|>`."""
    info, hf = _checkpoint(tmp_path / "gpt-oss")
    cluster.model_info = info
    agent = await cluster.add_site("oslo", 59.9, 10.7)
    agent.__class__ = ScriptedAgent
    ends = {hf.convert_tokens_to_ids("<|return|>"), hf.convert_tokens_to_ids("<|call|>")}

    def play(text: str) -> list[int]:
        ids = hf.encode(text, add_special_tokens=False)
        assert hf.decode(ids) == text
        agent.script = ids
        agent.eos_id = ids[-1] if ids[-1] in ends else hf.convert_tokens_to_ids("<|return|>")
        return ids

    key = await cluster.create_key()
    _router, url = await make_router()
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30) as client:
        yield client, play, hf, agent


async def _answer(client, **body) -> tuple[dict, dict]:
    """The whole response's choice and the streamed one's, joined, in one shape."""
    body = {"model": MODEL, "messages": USER, "max_tokens": 200, **body}
    whole = await client.chat.completions.create(**body)
    content, reasoning, calls, finish = "", "", {}, None
    async for chunk in await client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            for part in choice.delta.tool_calls or ():
                name, arguments = calls.setdefault(part.index, ("", ""))
                calls[part.index] = (name + (part.function.name or ""), arguments + (part.function.arguments or ""))
            finish = choice.finish_reason or finish
    message = whole.choices[0].message
    return ({"reasoning": message.model_extra.get("reasoning_content") or None, "content": message.content or None,
             "calls": [(c.function.name, c.function.arguments) for c in message.tool_calls or ()],
             "finish": whole.choices[0].finish_reason},
            {"reasoning": reasoning or None, "content": content or None, "calls": list(calls.values()),
             "finish": finish})


async def test_analysis_is_reasoning_and_final_is_content(harmony):
    client, play, _hf, _agent = harmony
    ids = play(f"{ANALYSIS}<|channel|>final<|message|>It is 3.<|return|>")
    whole, streamed = await _answer(client)
    assert whole == streamed == {"reasoning": THOUGHT, "content": "It is 3.", "calls": [], "finish": "stop"}
    usage = (await client.chat.completions.create(model=MODEL, messages=USER, max_tokens=200)).usage
    assert usage.completion_tokens == len(ids)
    # the analysis message: its header, body and end
    assert usage.completion_tokens_details.reasoning_tokens == ids.index(_hf.convert_tokens_to_ids("<|end|>")) + 1


async def test_a_final_answer_without_analysis(harmony):
    client, play, _hf, _agent = harmony
    play("<|channel|>final<|message|>It is 3.<|return|>")
    for tools in (None, TOOLS):
        whole, streamed = await _answer(client, **({"tools": tools} if tools else {}))
        assert whole == streamed == {"reasoning": None, "content": "It is 3.", "calls": [], "finish": "stop"}


@pytest.mark.parametrize("call", [CALL, f" to=functions.add<|channel|>commentary json<|message|>{ARGS}<|call|>"],
                         ids=["channel-first", "recipient-first"])
@pytest.mark.parametrize("tool_choice", ["auto", "required"])
async def test_a_tool_call(harmony, call, tool_choice):
    """The call's streamed deltas join into the whole answer's arguments, as written; the thoughts before it are
    reasoning; nothing is content."""
    client, play, _hf, _agent = harmony
    play(ANALYSIS + call)
    whole, streamed = await _answer(client, tools=TOOLS, tool_choice=tool_choice)
    assert whole == streamed == {"reasoning": THOUGHT, "content": None, "calls": [("add", ARGS)],
                                 "finish": "tool_calls"}
    named = {"type": "function", "function": {"name": "add"}}
    assert (await _answer(client, tools=TOOLS, tool_choice=named))[0] == whole


async def test_a_preamble_then_a_call(harmony):
    """A commentary message to no one is the model speaking to the user before it calls: content."""
    client, play, _hf, _agent = harmony
    play(f"{ANALYSIS}<|channel|>commentary<|message|>Let me add them.<|end|><|start|>assistant{CALL}")
    whole, streamed = await _answer(client, tools=TOOLS)
    assert whole == streamed == {"reasoning": THOUGHT, "content": "Let me add them.", "calls": [("add", ARGS)],
                                 "finish": "tool_calls"}


async def test_a_call_of_a_function_not_offered_is_no_call(harmony):
    """As in every format, an answer without a call of an offered function is the text the model wrote: here the
    call's message as the router reads it (its recipient, its arguments), with no header words glued in."""
    client, play, _hf, _agent = harmony
    play(CALL.replace("functions.add", "functions.drop_tables"))
    whole, streamed = await _answer(client, tools=TOOLS)
    assert whole == streamed == {"reasoning": None, "content": f"<|start|>functions.drop_tables<|message|>{ARGS}",
                                 "calls": [], "finish": "stop"}


async def test_cut_by_max_tokens_inside_the_analysis(harmony):
    client, play, hf, _agent = harmony
    ids = play(f"{ANALYSIS}<|channel|>final<|message|>It is 3.<|return|>")
    cut = next(k for k in range(len(ids)) if "sum" in hf.decode(ids[:k]))
    whole, streamed = await _answer(client, max_tokens=cut)
    assert whole == streamed
    assert whole["content"] is None and whole["calls"] == [] and whole["finish"] == "length"
    assert THOUGHT.startswith(whole["reasoning"]) and whole["reasoning"].endswith("sum")


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
async def test_cut_by_max_tokens_inside_a_call(harmony, tool_choice):
    """The call as far as it got, as the other formats' cut calls; cut inside its header, no call and no text."""
    client, play, hf, _agent = harmony
    ids = play(ANALYSIS + CALL)
    text = hf.decode(ids)
    in_args = next(k for k in range(len(ids)) if len(hf.decode(ids[:k])) > text.index('"b"'))
    whole, streamed = await _answer(client, tools=TOOLS, tool_choice=tool_choice, max_tokens=in_args)
    assert whole == streamed
    (name, arguments), = whole["calls"]
    assert name == "add" and ARGS.startswith(arguments) and '"a": 1' in arguments and arguments != ARGS
    assert whole["content"] is None and whole["reasoning"] == THOUGHT and whole["finish"] == "length"
    in_header = next(k for k in range(len(ids)) if "to=functions.ad" in hf.decode(ids[:k]))
    whole, streamed = await _answer(client, tools=TOOLS, tool_choice=tool_choice, max_tokens=in_header)
    assert whole == streamed == {"reasoning": THOUGHT, "content": None, "calls": [], "finish": "length"}


def _sent_grammar(agent) -> GrammarSpec:
    request = next(request for method, request in reversed(agent.calls) if method != "GetModelInfo")
    kind = request.sampling.grammar.WhichOneof("source")
    return GrammarSpec(kind, getattr(request.sampling.grammar, kind))


def _accepts(hf, spec: GrammarSpec, text: str) -> bool:
    """Whether a model constrained by `spec` may write `text` (as the tokenizer encodes it) and end there."""
    tokenizer = ChatTokenizer(hf.backend_tokenizer.to_str(), {})
    ends = [hf.convert_tokens_to_ids(token) for token in ("<|return|>", "<|call|>")]
    matcher = GrammarCompiler(tokenizer.tokenizer.to_str(), tokenizer.vocab_size, ends, num_threads=1).matcher(spec)
    ids = hf.encode(text, add_special_tokens=False)
    return all(matcher.consume(t) for t in ids) and matcher.matcher.is_accepting()


async def test_a_required_call_is_forced_as_a_harmony_message(harmony):
    """The grammar sent with a required (or named) call lets gpt-oss think, then write the call's message, with
    arguments that follow the function's schema; never a final answer instead."""
    client, play, hf, agent = harmony
    play(ANALYSIS + CALL)
    for tool_choice in ("required", {"type": "function", "function": {"name": "add"}}):
        await client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice=tool_choice)
        spec = _sent_grammar(agent)
        assert _accepts(hf, spec, ANALYSIS + CALL) and _accepts(hf, spec, CALL)
        assert not _accepts(hf, spec, "<|channel|>final<|message|>It is 3.")
        assert not _accepts(hf, spec, CALL.replace(ARGS, '{"a": "one", "b": 2}'))
        assert _accepts(hf, spec, CALL.replace("add", "city_time").replace(ARGS, '{"city": "Oslo"}')) == (
            tool_choice == "required")


async def test_response_format_and_strict_tools_are_harmony_messages(harmony):
    """A response format is the final message's JSON, after the analysis; strict tools under auto let the
    model answer in words or call, a preamble first."""
    client, play, hf, agent = harmony
    play("<|channel|>final<|message|>{\"sum\": 3}<|return|>")
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"],
              "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "sum", "schema": schema}}
    whole = await client.chat.completions.create(model=MODEL, messages=USER, response_format=response_format)
    assert whole.choices[0].message.content == '{"sum": 3}'
    spec = _sent_grammar(agent)
    final = '<|channel|>final<|message|>{"sum": 3}'
    assert _accepts(hf, spec, ANALYSIS + final) and _accepts(hf, spec, final)
    assert not _accepts(hf, spec, '{"sum": 3}') and not _accepts(hf, spec, ANALYSIS + CALL)
    strict = {"type": "function", "function": {**ADD["function"], "strict": True}}
    await client.chat.completions.create(model=MODEL, messages=USER, tools=[strict])
    spec = _sent_grammar(agent)
    preamble = "<|channel|>commentary<|message|>Let me add them.<|end|><|start|>assistant"
    assert _accepts(hf, spec, ANALYSIS + "<|channel|>final<|message|>It is 3.")
    assert _accepts(hf, spec, ANALYSIS + preamble + CALL) and _accepts(hf, spec, CALL)
    assert not _accepts(hf, spec, CALL.replace(ARGS, '{"a": "one", "b": 2}'))
    await client.chat.completions.create(model=MODEL, messages=USER, tools=[strict], response_format=response_format)
    spec = _sent_grammar(agent)
    assert _accepts(hf, spec, ANALYSIS + final) and _accepts(hf, spec, ANALYSIS + CALL)
    assert not _accepts(hf, spec, ANALYSIS + "<|channel|>final<|message|>It is 3.")


async def test_an_earlier_call_and_its_result_reach_the_model_as_transformers_renders_them(harmony):
    """An openai-client history (the reasoning and a call with JSON-string arguments, the tool's result, then a
    final answer) and `reasoning_effort` give the prompt ids transformers renders from the stored template: in the
    middle of the tool loop the call's thoughts are shown to the model, after a final answer they are not."""
    client, play, hf, agent = harmony
    play("<|channel|>final<|message|>Done.<|return|>")
    history = [
        {"role": "system", "content": "Be brief."},
        *USER,
        {"role": "assistant", "content": None, "reasoning_content": THOUGHT, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        {"role": "assistant", "content": "It is 3."},
        {"role": "user", "content": "And 2 and 2?"},
    ]
    as_transformers = [
        *history[:2],
        {"role": "assistant", "thinking": THOUGHT, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": json.loads(ARGS)}}]},
        *history[3:],
    ]
    call = f"<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{ARGS}<|call|>"
    for turns, effort in ((4, None), (4, "high"), (6, "low")):
        body = {"model": MODEL, "messages": history[:turns], "tools": TOOLS, "max_tokens": 8}
        await client.chat.completions.create(**body, **({"reasoning_effort": effort} if effort else {}))
        request = next(request for method, request in reversed(agent.calls) if method != "GetModelInfo")
        expected = hf.apply_chat_template(as_transformers[:turns], tools=TOOLS, add_generation_prompt=True,
                                          return_dict=False, **({"reasoning_effort": effort} if effort else {}))
        assert list(request.prompt_ids) == list(expected)
        prompt = hf.decode(request.prompt_ids)
        assert f"Reasoning: {effort or 'medium'}" in prompt and call in prompt
        assert '<|start|>functions.add to=assistant<|channel|>commentary<|message|>"3"<|end|>' in prompt
        assert (f"<|channel|>analysis<|message|>{THOUGHT}<|end|>" in prompt) == (turns == 4)
