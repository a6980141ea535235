"""A gpt-oss answer sent back as history: the router answers a preamble then a call with `content` (the
preamble), `reasoning_content` and `tool_calls`, a turn the stored template refuses ("Cannot pass both content
and thinking"). A client that replays what it received is served, and the model reads the turn as transformers
renders it folded: the preamble after the thoughts, in the one analysis message the template shows.

The site is the harmony tests' scripted fake agent (tests/router/test_router_harmony.py)."""

from __future__ import annotations

import json

import jinja2
import pytest
from router_fake_agent import MODEL

from tests.router.test_router_harmony import ARGS, TOOLS, USER, harmony  # noqa: F401 — the fixture

THOUGHT = "The user wants a sum. I can add them with the tool."
PREAMBLE = "Let me add them."
ANSWER = (f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>commentary<|message|>"
          f"{PREAMBLE}<|end|><|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>"
          f"{ARGS}<|call|>")


def _last_prompt(agent) -> list[int]:
    return list(next(request for method, request in reversed(agent.calls) if method != "GetModelInfo").prompt_ids)


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning", "thinking"])
async def test_a_replayed_preamble_and_call_is_served_as_the_folded_turn(harmony, key):  # noqa: F811
    client, play, hf, agent = harmony
    play(ANSWER)
    first = await client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=200)
    message = first.choices[0].message
    assert message.content == PREAMBLE and message.model_extra["reasoning_content"] == THOUGHT
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("add", ARGS)]

    replayed = message.model_dump(exclude_none=True)
    replayed[key] = replayed.pop("reasoning_content")
    history = [*USER, replayed, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "3"}]
    play("<|channel|>final<|message|>It is 3.<|return|>")
    second = await client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=200)
    assert second.choices[0].message.content == "It is 3."

    # transformers refuses the turn as sent, and renders the folded one as the router's prompt
    with pytest.raises(jinja2.TemplateError, match="Cannot pass both content and thinking"):
        hf.apply_chat_template([*USER, {**replayed, "thinking": THOUGHT}, history[2]], tools=TOOLS,
                               add_generation_prompt=True)
    folded = {"role": "assistant", "content": "", "thinking": f"{THOUGHT}\n\n{PREAMBLE}", "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": json.loads(ARGS)}}
        for c in message.tool_calls]}
    expected = hf.apply_chat_template([*USER, folded, history[2]], tools=TOOLS, add_generation_prompt=True,
                                      return_dict=False)
    assert _last_prompt(agent) == list(expected)
    prompt = hf.decode(_last_prompt(agent))
    assert f"<|channel|>analysis<|message|>{THOUGHT}\n\n{PREAMBLE}<|end|>" in prompt


async def test_after_a_final_answer_the_folded_turn_is_hidden_as_any_calling_turns_thoughts(harmony):  # noqa: F811
    """Later in the conversation the template drops a calling turn's analysis: the folded preamble goes with it,
    and a turn with only one of the two is left as the client sent it."""
    client, play, hf, agent = harmony
    play("<|channel|>final<|message|>Done.<|return|>")
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": ARGS}}
    history = [*USER, {"role": "assistant", "content": PREAMBLE, "reasoning_content": THOUGHT, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"},
               {"role": "assistant", "content": "It is 3."}, {"role": "user", "content": "Thanks."}]
    await client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8)
    prompt = hf.decode(_last_prompt(agent))
    assert THOUGHT not in prompt and PREAMBLE not in prompt and "It is 3." in prompt

    preamble_only = [*USER, {"role": "assistant", "content": PREAMBLE, "tool_calls": [call]}, history[2]]
    await client.chat.completions.create(model=MODEL, messages=preamble_only, tools=TOOLS, max_tokens=8)
    as_transformers = [*USER, {**preamble_only[1], "tool_calls": [
        {**call, "function": {"name": "add", "arguments": json.loads(ARGS)}}]}, history[2]]
    assert _last_prompt(agent) == list(hf.apply_chat_template(as_transformers, tools=TOOLS,
                                                              add_generation_prompt=True, return_dict=False))
