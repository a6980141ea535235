"""GLM-4.5 / GLM-4.6 reasoning through the router: the model writes a newline, then `<think>...</think>`, then
its answer (its template puts `\\n<think>` after `<|assistant|>`); the thinking comes back apart as
`reasoning_content` (chat completions, streamed and not) and as a reasoning item (Responses); `reasoning_effort:
"none"` and `chat_template_kwargs.enable_thinking: false` switch it off as the template does (an empty
`<think></think>` closing the generation prompt, `/nothink` after the user's words), and the answer then starts at
its first word; a required call's grammar lets the model think first, newline included.

Scripted fake sites, as tests/router/test_router_reasoning.py, with the published templates and a tokenizer
carrying their control tokens."""

from __future__ import annotations

import pytest
from router_fake_agent import MODEL

from engine.grammar import GrammarCompiler
from node_agent.convert import grammar_from_proto
from tests.engine.chat_checkpoints import TEMPLATES
from tests.router.test_router_reasoning import USER, _both, _checkpoint, _client, _ids

GLM = ("zai-org-GLM-4.5", "zai-org-GLM-4.6")
NOW = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("template", GLM)
async def test_glm_thinking_comes_back_apart(cluster, make_router, tmp_path, template):
    info, hf = _checkpoint(tmp_path / "glm", template)
    thought = _ids(hf, "\nThe snow in Oslo is cold today.\n")
    script = [*_ids(hf, "\n<think>"), *thought, *_ids(hf, "</think>\nSnow, 3 degrees.")]
    assert hf.convert_tokens_to_ids("<think>") in script
    _agents, client = await _client(cluster, make_router, info, script)
    async with client:
        for reasoning, content, usage in await _both(client, messages=USER, max_tokens=64):
            assert (reasoning, content) == ("The snow in Oslo is cold today.\n", "Snow, 3 degrees.")
            # the newline before the block, its tags and its thoughts
            assert usage.completion_tokens_details.reasoning_tokens == len(thought) + 3
        response = await client.responses.create(model=MODEL, input="Weather in Oslo?", max_output_tokens=64)
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == "The snow in Oslo is cold today.\n"
        assert response.output_text == "Snow, 3 degrees."


@pytest.mark.parametrize("template", GLM)
@pytest.mark.parametrize("switch", [{"reasoning_effort": "none"},
                                    {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}])
async def test_thinking_off_closes_the_block_in_the_prompt_and_answers_in_content(cluster, make_router, tmp_path,
                                                                                  template, switch):
    info, hf = _checkpoint(tmp_path / "glm", template)
    agents, client = await _client(cluster, make_router, info, _ids(hf, "\nSnow, 3 degrees."))
    async with client:
        for reasoning, content, usage in await _both(client, messages=USER, max_tokens=64, **switch):
            assert not reasoning and content == "Snow, 3 degrees."
            assert not usage.completion_tokens_details.reasoning_tokens
        _method, request = agents[0].calls[-1]
        prompt = hf.decode(list(request.prompt_ids))
        assert prompt.endswith("Weather in Oslo?/nothink<|assistant|>\n<think></think>")
        await client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8)
        _method, request = agents[0].calls[-1]
        assert hf.decode(list(request.prompt_ids)).endswith("Weather in Oslo?<|assistant|>")  # thinking by default


async def test_a_required_call_may_follow_glm_s_thinking(cluster, make_router, tmp_path):
    """The grammar of a required call lets GLM write its newline and block first, and its answer be the call."""
    template = "zai-org-GLM-4.6"
    info, hf = _checkpoint(tmp_path / "glm", template)
    text = "\n<think>The zone is UTC.</think>\n<tool_call>now\n<arg_key>zone</arg_key>\n<arg_value>utc</arg_value>\n" \
           "</tool_call>"
    agents, client = await _client(cluster, make_router, info, _ids(hf, text))
    async with client:
        for thinking in ({}, {"reasoning_effort": "none"}):
            choice = (await client.chat.completions.create(model=MODEL, messages=USER, tools=[NOW],
                                                           tool_choice="required", max_tokens=64,
                                                           **thinking)).choices[0]
            _method, request = agents[0].calls[-1]
            spec = grammar_from_proto(request.sampling.grammar)
            compiler = GrammarCompiler(info.tokenizer_json, len(hf), [hf.convert_tokens_to_ids(TEMPLATES[template][1])])
            matcher = compiler.matcher(spec)
            written = text if not thinking else text[text.index("<tool_call>"):]
            assert all(matcher.consume(t) for t in _ids(hf, written)) and matcher.matcher.is_accepting(), thinking
            if not thinking:
                assert choice.message.model_extra["reasoning_content"] == "The zone is UTC."
                assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
                    ("now", '{"zone": "utc"}')]
