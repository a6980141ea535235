"""An agent configured to speculate answers as one that does not, and reports how its proposals fared."""

from __future__ import annotations

import httpx
import pytest

from node_agent.proto import agent_pb2
from tests.agent.conftest import MODEL, collect, prompt, sampling
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
