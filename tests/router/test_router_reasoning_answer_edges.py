"""Where a reasoning model's answer begins, through the router (scripted fake sites, as
tests/router/test_router_reasoning.py): the blank lines after a reasoning block (the model's, or the empty one a
prompt closes to turn thinking off) are dropped, yet the answer's first line keeps its indentation; and blank
tokens held at the start (GLM writes a newline before `<think>`) still reach the answer when the output ends
among them (max_tokens)."""

from __future__ import annotations

import pytest

from tests.router.test_router_reasoning import USER, _both, _checkpoint, _client, _ids

CODE = "    return x * 2\n"
NO_THINKING = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
# template -> what the model writes before the code, and the request; the prompts end `</think>\n\n` (Qwen3 without
# thinking), `<think></think>` (GLM without), and GLM writes its own block
CASES = {
    "Qwen-Qwen3-0.6B": [("", NO_THINKING)],
    "zai-org-GLM-4.6": [("\n", {"reasoning_effort": "none"}), ("\n<think>Indent it.</think>\n\n", {})],
}


@pytest.mark.parametrize("template", sorted(CASES))
async def test_an_answer_keeps_its_first_indentation_and_the_blanks_it_was_cut_in(cluster, make_router, tmp_path,
                                                                                  template):
    info, hf = _checkpoint(tmp_path / "m", template)
    agents, client = await _client(cluster, make_router, info, [])
    async with client:
        for before, switch in CASES[template]:
            agents[0].script = _ids(hf, before + CODE)
            for _reasoning, content, _usage in await _both(client, messages=USER, max_tokens=64, **switch):
                assert content == CODE, before
        agents[0].script = _ids(hf, "\n\nSnow.")
        assert len(_ids(hf, "\n\n")) == 2
        for reasoning, content, usage in await _both(client, messages=USER, max_tokens=2):
            assert not reasoning and content == "\n\n" and usage.completion_tokens == 2
