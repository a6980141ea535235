"""A reader that fell behind on a request with a predicted output (engine.async_engine): the events it may
pass on together (`more`) never span a step that verified the prediction's proposals, except as their first,
so a consumer that cuts the answer inside a message knows which of its tokens were kept proposals."""

from __future__ import annotations

import pytest

from engine.async_engine import AsyncEngine
from engine.engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from tests.engine.test_async_relay import until_idle

MAX_TOKENS = 16


@pytest.fixture
def engine(llama_checkpoint):
    made = AsyncEngine(LLMEngine(llama_checkpoint[0], EngineConfig(kv_cache_bytes=8 << 20, show_progress=False)))
    yield made
    made.shutdown()


def messages(events: list) -> list[list]:
    """The events grouped as the agent sends them: an event saying another is waiting is held for it."""
    grouped, held = [], []
    for event in events:
        held.append(event)
        if not event.more or event.finish_reason:
            grouped.append(held)
            held = []
    return grouped


async def test_a_message_holds_its_verified_proposals_first(engine):
    prompt = list(range(3, 20))
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    expected = [e.token_id async for e in engine.generate(prompt, plain)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, prediction_ids=expected)
    stream = engine.generate(prompt, params)
    first = await anext(stream)
    await until_idle(engine)  # the reader reads nothing while the engine makes the other tokens
    rest = [event async for event in stream]
    assert [first.token_id] + [e.token_id for e in rest] == expected
    counted = [(e.num_accepted_prediction_tokens, e.num_rejected_prediction_tokens) for e in rest]
    assert counted[-1][0] > MAX_TOKENS // 2 and counted[-1][1] == 0
    grouped = messages(rest)
    assert len(grouped) > 1
    for message in grouped:
        # one step's counts per message: its kept proposals are its first tokens
        assert len({(e.num_accepted_prediction_tokens, e.num_rejected_prediction_tokens) for e in message}) == 1
