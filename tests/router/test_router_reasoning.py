"""Reasoning models through the router: `reasoning_content` apart from `content`, streamed and not, the
same after a mid-stream resume on another site, reasoning tokens in usage; models that do not reason
are left alone.

The sites are fake agents that play a scripted token sequence (the router's side is what is under
test here; tests/router/test_router_reasoning_model.py runs a real engine)."""

from __future__ import annotations

import json

import openai
import pytest
from router_fake_agent import MODEL, FakeAgent, model_info_from_dir

from tests.engine.chat_checkpoints import TEMPLATES, write_template_tokenizer


class ScriptedAgent(FakeAgent):
    script: list[int] = []

    def token_at(self, prompt_ids, position: int) -> int:
        return self.script[position] if position < len(self.script) else self.eos_id


def _checkpoint(directory, template: str):
    from transformers import AutoTokenizer

    write_template_tokenizer(directory, template)
    hf = AutoTokenizer.from_pretrained(str(directory))
    (directory / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [hf.convert_tokens_to_ids(TEMPLATES[template][1])]}))
    info = model_info_from_dir(directory)
    info.chat_template = (directory / "chat_template.jinja").read_text()
    return info, hf


async def _client(cluster, make_router, info, script: list[int], num_sites: int = 1, **router_settings):
    cluster.model_info = info
    agents = []
    for i in range(num_sites):
        agent = await cluster.add_site(f"site{i}", 50.1 + i, 8.7)
        agent.__class__ = ScriptedAgent
        agent.script = script
        agents.append(agent)
    key = await cluster.create_key()
    _router, url = await make_router(**router_settings)
    return agents, openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def _ids(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False)


async def _both(client, **request):
    """(reasoning, content, usage) of the request, non-streamed and streamed."""
    completion = await client.chat.completions.create(model=MODEL, **request)
    message = completion.choices[0].message
    stream = await client.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                                  **request)
    reasoning, content, usage = "", "", None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    return (message.model_extra.get("reasoning_content"), message.content, completion.usage), (reasoning, content,
                                                                                                usage)


USER = [{"role": "user", "content": "Weather in Oslo?"}]


async def test_qwen3_reasoning_is_returned_apart_and_survives_a_resume(cluster, make_router, tmp_path):
    info, hf = _checkpoint(tmp_path / "qwen3", "Qwen-Qwen3-0.6B")
    think, end_think = hf.convert_tokens_to_ids("<think>"), hf.convert_tokens_to_ids("</think>")
    thought, answer = _ids(hf, "\nThe snow in Oslo is cold today.\n"), _ids(hf, "\n\nSnow, 3 degrees.")
    script = [think, *thought, end_think, *answer]
    agents, client = await _client(cluster, make_router, info, script, num_sites=2)
    async with client:
        plain, streamed = await _both(client, messages=USER, max_tokens=64)
        for reasoning, content, usage in (plain, streamed):
            assert reasoning == "The snow in Oslo is cold today.\n"
            assert content == "Snow, 3 degrees."
            assert usage.completion_tokens == len(script) + 1  # and the end-of-turn token
            assert usage.completion_tokens_details.reasoning_tokens == len(thought) + 2
        # The first site dies in the middle of the reasoning; the stream resumes on the other one.
        for agent in agents:
            agent.die_after = 3
        agents[1].die_after = None
        stream = await client.chat.completions.create(model=MODEL, messages=USER, max_tokens=64, stream=True)
        reasoning, content = "", ""
        async for chunk in stream:
            for choice in chunk.choices:
                reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                content += choice.delta.content or ""
        assert (reasoning, content) == plain[:2]
        assert any(method == "Decode" and list(request.generated_ids) for method, request in agents[1].calls)


async def test_a_prompt_that_opens_the_block_gets_only_the_end_tag(cluster, make_router, tmp_path):
    """DeepSeek-V3.1 with `thinking` ends its generation prompt with `<think>`: the output starts inside
    the reasoning."""
    info, hf = _checkpoint(tmp_path / "v31", "deepseek-ai-DeepSeek-V3.1")
    script = [*_ids(hf, "Cold in Oslo."), hf.convert_tokens_to_ids("</think>"), *_ids(hf, "\n\nSnow.")]
    _agents, client = await _client(cluster, make_router, info, script)
    async with client:
        for reasoning, content, usage in await _both(client, messages=USER, max_tokens=64,
                                                     extra_body={"chat_template_kwargs": {"thinking": True}}):
            assert (reasoning, content) == ("Cold in Oslo.", "Snow.")
            assert usage.completion_tokens_details.reasoning_tokens == len(_ids(hf, "Cold in Oslo.")) + 1


async def test_thinking_switched_off_answers_in_content(cluster, make_router, tmp_path):
    info, hf = _checkpoint(tmp_path / "qwen3", "Qwen-Qwen3-0.6B")
    _agents, client = await _client(cluster, make_router, info, _ids(hf, "Snow."))
    async with client:
        for reasoning, content, usage in await _both(client, messages=USER, max_tokens=64,
                                                     extra_body={"chat_template_kwargs": {"enable_thinking": False}}):
            assert not reasoning and content == "Snow."
            assert usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("template, settings", [("meta-llama-Llama-3.1-8B-Instruct", {}),
                                                ("Qwen-Qwen3-0.6B", {"reasoning_parsers": {MODEL: "none"}})])
async def test_models_that_do_not_reason_are_left_alone(cluster, make_router, tmp_path, template, settings):
    """No reasoning format (a template without think tags, or the operator's "none"): the text that looks
    like reasoning is the answer, and no reasoning fields appear."""
    info, hf = _checkpoint(tmp_path / "model", template)
    text = "<think>not a thought</think>Snow."
    _agents, client = await _client(cluster, make_router, info, _ids(hf, text), **settings)
    async with client:
        completion = await client.chat.completions.create(model=MODEL, messages=USER, max_tokens=64)
    message = completion.choices[0].message
    assert "reasoning_content" not in (message.model_extra or {})
    assert completion.usage.completion_tokens_details is None
    assert message.content == hf.decode(_ids(hf, text), skip_special_tokens=True)
