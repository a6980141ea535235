"""An agent configured to speculate answers as one that does not, and reports how its proposals fared."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest

from node_agent.proto import agent_pb2
from tests.agent.conftest import MODEL, agent_config, collect, prompt, sampling
from typed_config import ConfigError
from tests.metrics_text import Samples


async def test_a_speculating_agent_answers_alike_and_reports_its_acceptance(start_agent, connect, tiny_model_dir):
    plain = await start_agent("site-a")
    # the model as its own draft: every greedy proposal is kept, so the counts are known to move
    speculating = await start_agent("site-b", metrics_listen="127.0.0.1:0", speculative_method="draft",
                                    speculative_tokens=3, speculative_draft_model=str(tiny_model_dir))
    for params in (sampling(max_tokens=30), sampling(max_tokens=20, temperature=0.8, seed=3, no_speculation=True)):
        request = agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(30), sampling=params)
        assert await collect(connect(speculating).generate(request)) == await collect(connect(plain).generate(request))
    # a step's accepted tokens travel in one message (1 + 3 each; more when the reader falls behind)
    request = agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(30), sampling=sampling(max_tokens=30, logprobs=2))
    batched = [chunk async for chunk in connect(speculating).generate(request)]
    single = [chunk async for chunk in connect(plain).generate(request)]
    assert [t.token_id for c in batched for t in c.tokens] == [t.token_id for c in single for t in c.tokens]
    assert len(batched) <= 30 // 4 + 2
    assert all(len(t.top_logprobs) == 2 for c in batched for t in c.tokens)
    assert [c.finish_reason for c in batched] == [""] * (len(batched) - 1) + ["length"]
    async with httpx.AsyncClient() as http:
        samples = Samples.parse((await http.get(f"http://127.0.0.1:{speculating.metrics_port}/metrics")).text)
    proposed = samples.get("edgefire_agent_speculative_draft_tokens_total", model=MODEL)
    accepted = samples.get("edgefire_agent_speculative_accepted_tokens_total", model=MODEL)
    assert 0 < accepted <= proposed
    assert samples.get("edgefire_agent_speculative_acceptance_ratio", model=MODEL) == pytest.approx(accepted / proposed)
    assert samples.get("edgefire_agent_speculative_verifications_total", model=MODEL) > 0
    assert (await speculating.capacity()).speculative_acceptance == pytest.approx(accepted / proposed)


@pytest.mark.parametrize("change", ["vocab_size", "token_ids"])
def test_a_draft_that_cannot_share_the_models_tokens_is_refused_at_start(tiny_model_dir, tmp_path, change):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_model_dir, draft)
    if change == "vocab_size":
        config = json.loads((draft / "config.json").read_text())
        config["vocab_size"] = 200  # the tokenizer's ids reach past it
        (draft / "config.json").write_text(json.dumps(config))
    else:
        tokenizer = json.loads((draft / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        first, second = list(vocab)[100], list(vocab)[200]
        vocab[first], vocab[second] = vocab[second], vocab[first]
        (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match=re.escape(f"speculative_draft_model: cannot draft for models.{MODEL}: "
                                                    f"the draft model {draft}")):
        agent_config(tiny_model_dir, speculative_method="draft", speculative_draft_model=str(draft))
