"""Seed-OSS reasoning through the router (parser `seed`, from its published template): the model writes
`<seed:think>...</seed:think>` before its answer, which comes back apart as `reasoning_content`, streamed and not.
Its template's switch is a budget of tokens, `thinking_budget` (-1, unlimited, by default; 0: no thinking, and the
generation prompt then opens the block, `<seed:think><seed:cot_budget_reflect>`, for the model's note on the
budget): `reasoning_effort: "none"` sets it to 0, the model's note comes back as reasoning and its answer as content;
the template names no budget for other efforts, so they leave it unlimited, and an effort that contradicts the
budget the request sets is a 400.

Scripted fake sites, as tests/router/test_router_reasoning.py, with the published template and a tokenizer carrying
its control tokens."""

from __future__ import annotations

import openai
import pytest
from router_fake_agent import MODEL

from engine.grammar import json_schema_spec
from router.reasoning import reasoning_format, template_effort, with_reasoning
from tests.router.test_router_reasoning import USER, _both, _checkpoint, _client, _ids
from tests.router.tool_call_checks import grammar_accepts, grammar_compiler

SEED = "ByteDance-Seed-Seed-OSS-36B-Instruct"


async def test_seed_thinking_comes_back_apart_and_none_sets_a_budget_of_zero(cluster, make_router, tmp_path):
    info, hf = _checkpoint(tmp_path / "seed", SEED)
    script = _ids(hf, "<seed:think>The snow in Oslo is cold today.\n</seed:think>\nSnow, 3 degrees.")
    assert hf.convert_tokens_to_ids("<seed:think>") == script[0]
    agents, client = await _client(cluster, make_router, info, script)
    async with client:
        for reasoning, content, _usage in await _both(client, messages=USER, max_tokens=64, reasoning_effort="high"):
            assert (reasoning, content) == ("The snow in Oslo is cold today.\n", "Snow, 3 degrees.")
        _method, request = agents[0].calls[-1]
        assert hf.decode(list(request.prompt_ids)).endswith("Weather in Oslo?<seed:eos><seed:bos>assistant\n")

        note = "The current thinking budget is 0, so I will directly start answering the question."
        for agent in agents:
            agent.script = _ids(hf, f"{note}</seed:cot_budget_reflect>\n</seed:think>\nSnow, 3 degrees.")
        for reasoning, content, _usage in await _both(client, messages=USER, max_tokens=64, reasoning_effort="none"):
            assert reasoning.startswith(note) and content == "Snow, 3 degrees."
        _method, request = agents[0].calls[-1]
        prompt = hf.decode(list(request.prompt_ids))
        assert "your thinking budget is 0" in prompt
        assert prompt.endswith("<seed:bos>assistant\n<seed:think><seed:cot_budget_reflect>")


@pytest.mark.parametrize("effort, budget", [("none", 512), ("low", 0)])
async def test_an_effort_that_contradicts_the_budget_is_a_400(cluster, make_router, tmp_path, effort, budget):
    info, hf = _checkpoint(tmp_path / "seed", SEED)
    _agents, client = await _client(cluster, make_router, info, _ids(hf, "Snow."))
    async with client:
        with pytest.raises(openai.BadRequestError, match="thinking_budget"):
            await client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, reasoning_effort=effort,
                                                 extra_body={"chat_template_kwargs": {"thinking_budget": budget}})


@pytest.mark.parametrize("effort, output", [
    ("none", "The current thinking budget is 0, so I will directly start answering the question."
             "</seed:cot_budget_reflect>\n\n</seed:think>\n"),
    ("high", "<seed:think>Oslo, then.<seed:cot_budget_reflect>I have used 129 tokens, and there are 383 tokens "
             "remaining for use.</seed:cot_budget_reflect>\nSnow.</seed:think>\n")])
def test_a_grammar_lets_the_model_write_its_notes_on_the_budget(template_tokenizer, effort, output):
    """Under a response format (or a required call) the reasoning is free text, and Seed-OSS's notes on its budget
    are special tokens, which text cannot hold: the grammar admits them where the model writes them (the note a
    budget of 0 asks for, closed before the block's end tag; the notes every so many tokens of a budget)."""
    tokenizer = template_tokenizer(SEED)
    kwargs = template_effort({"reasoning_effort": effort}, reasoning_format(tokenizer), tokenizer.template, MODEL)
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(USER, **kwargs), add_special_tokens=False)
    spec = with_reasoning(json_schema_spec({"type": "object"}), reasoning_format(tokenizer), prompt_ids, tokenizer,
                          kwargs)
    assert grammar_accepts(grammar_compiler(tokenizer, SEED), tokenizer, spec, output + '{"snow": true}')
