"""Structured output and required tool calls on a prompt that opens the reasoning block (DeepSeek-V3.1
with `thinking`): the grammar the site gets lets the model reason, then close the block, then write the
constrained answer, which comes back as `content` or `tool_calls` (not as reasoning). The grammar is
checked against the model's own tokenizer; the scripted site plays what a model under it writes."""

from __future__ import annotations

import json

from test_router_reasoning import USER, _checkpoint, _client, _ids

from engine.grammar import GrammarCompiler, GrammarSpec
from engine.tokenizer import ChatTokenizer
from tests.engine.chat_checkpoints import TEMPLATES

TEMPLATE = "deepseek-ai-DeepSeek-V3.1"
THINKING = {"chat_template_kwargs": {"thinking": True}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}


def _site_grammar(agent, directory) -> tuple[GrammarCompiler, GrammarSpec]:
    sampling = next(request.sampling for method, request in agent.calls if method in ("Generate", "Prefill"))
    kind = sampling.grammar.WhichOneof("source")
    tokenizer = ChatTokenizer.from_dir(directory)
    eos = tokenizer.token_to_id(TEMPLATES[TEMPLATE][1])
    compiler = GrammarCompiler(tokenizer.tokenizer.to_str(), tokenizer.vocab_size, [eos], num_threads=1)
    return compiler, GrammarSpec(kind, getattr(sampling.grammar, kind))


def _follows(compiler: GrammarCompiler, spec: GrammarSpec, ids: list[int]) -> bool:
    matcher = compiler.matcher(spec)
    return all(matcher.consume(t) for t in ids) and matcher.matcher.is_accepting()


async def test_json_answer_follows_the_reasoning_of_an_open_block(cluster, make_router, tmp_path):
    info, hf = _checkpoint(tmp_path / "v31", TEMPLATE)
    end_think = hf.convert_tokens_to_ids("</think>")
    script = [*_ids(hf, "Cold in Oslo."), end_think, *_ids(hf, '{"city": "Oslo"}')]
    agents, client = await _client(cluster, make_router, info, script)
    async with client:
        answer = await client.chat.completions.create(
            model="tiny-llama", messages=USER, max_tokens=64, extra_body=THINKING,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER["function"][
                "parameters"]}})
    message = answer.choices[0].message
    assert (message.model_extra["reasoning_content"], json.loads(message.content)) == ("Cold in Oslo.", {"city": "Oslo"})
    compiler, spec = _site_grammar(agents[0], tmp_path / "v31")
    assert _follows(compiler, spec, script)
    assert not _follows(compiler, spec, [*_ids(hf, "Cold."), end_think, *_ids(hf, '{"town": "Oslo"}')])


async def test_required_call_follows_the_reasoning_of_an_open_block(cluster, make_router, tmp_path):
    info, hf = _checkpoint(tmp_path / "v31", TEMPLATE)
    token = hf.convert_tokens_to_ids
    script = [*_ids(hf, "Need the weather."), token("</think>"), token("<｜tool▁calls▁begin｜>"),
              token("<｜tool▁call▁begin｜>"), *_ids(hf, "get_weather"), token("<｜tool▁sep｜>"),
              *_ids(hf, '{"city": "Oslo"}'), token("<｜tool▁call▁end｜>"), token("<｜tool▁calls▁end｜>")]
    agents, client = await _client(cluster, make_router, info, script)
    async with client:
        answer = await client.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=64,
                                                      extra_body=THINKING, tools=[WEATHER], tool_choice="required")
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]
    compiler, spec = _site_grammar(agents[0], tmp_path / "v31")
    assert _follows(compiler, spec, script)
