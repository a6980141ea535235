"""Legacy completions with several prompts in one request and with `echo`, through the official client.

The fake agent's greedy tokens depend only on the prompt, so each prompt of a batch must get exactly
what it gets when sent alone.
"""

from __future__ import annotations

import json

import openai
import pytest
from router_fake_agent import MODEL

from engine.tokenizer import ChatTokenizer

PROMPTS = ["edge sites", "where is the nearest site to Lyon", "kv"]


@pytest.fixture
async def served(cluster, make_router):
    agent = await cluster.add_site("fra", 50.1, 8.7)
    agent.num_cached_tokens = 2
    key = await cluster.create_key()
    _router, url = await make_router()
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        yield client


@pytest.fixture
def tokenizer(model_info):
    return ChatTokenizer(model_info.tokenizer_json, json.loads(model_info.tokenizer_config_json))


async def _alone(client, prompts, **sampling):
    return [await client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0, **sampling)
            for p in prompts]


async def test_several_prompts_are_answered_prompt_major_as_each_alone(served):
    alone = await _alone(served, PROMPTS)
    batch = await served.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    assert batch.usage.prompt_tokens_details.cached_tokens == 2 * len(PROMPTS)  # each prompt once, whatever n
    assert len({batch.id, *(a.id for a in alone)}) == 4

    token_prompts = [[5, 6, 7], [8, 9]]
    alone = await _alone(served, token_prompts)
    batch = await served.completions.create(model=MODEL, prompt=token_prompts, max_tokens=5, temperature=0)
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == 5


async def test_a_stream_of_several_prompts_finishes_every_choice_and_sends_one_usage(served):
    whole = await served.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=5, temperature=0)
    stream = await served.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=5, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    texts, finished, usages = {}, {}, []
    async for chunk in stream:
        if chunk.usage:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert sorted(finished) == list(range(6))
    assert [texts[i] for i in range(6)] == [c.text for c in whole.choices]
    assert len(usages) == 1 and usages[0] == whole.usage


async def test_echo_starts_each_choice_with_its_prompt(served, tokenizer):
    token_prompt = [5, 6, 7]
    alone = await _alone(served, [PROMPTS[0], token_prompt])
    echoed = await served.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, max_tokens=5, temperature=0)
    assert echoed.choices[0].text == PROMPTS[0] + alone[0].choices[0].text
    assert echoed.usage == alone[0].usage
    echoed = await served.completions.create(model=MODEL, prompt=[token_prompt], echo=True, n=2, max_tokens=5,
                                             temperature=0)
    expected = tokenizer.decode(token_prompt, skip_special_tokens=False) + alone[1].choices[0].text
    assert [c.text for c in echoed.choices] == [expected, expected]

    stream = await served.completions.create(model=MODEL, prompt=PROMPTS[:2], echo=True, max_tokens=5,
                                             temperature=0, stream=True)
    pieces = {}
    async for chunk in stream:
        for choice in chunk.choices:
            pieces.setdefault(choice.index, []).append(choice.text)
    assert all(pieces[i][0].startswith(PROMPTS[i]) for i in (0, 1))  # the first chunk carries the prompt
    alone = await _alone(served, PROMPTS[:2])
    assert ["".join(pieces[i]) for i in (0, 1)] == [p + a.choices[0].text for p, a in zip(PROMPTS, alone)]


async def test_bad_prompt_arrays_and_echo_with_logprobs_are_refused(served):
    cases = [({"prompt": "x", "echo": True, "logprobs": 1}, 400, "logprobs", "prompt tokens are not returned"),
             ({"prompt": ["x", ""]}, 400, "prompt[1]", "must not be empty"),
             ({"prompt": []}, 400, "prompt", "non-empty"),
             ({"prompt": [[5, 6], [5] * 1100]}, 400, "prompt[1]", "`prompt[1]` is 1100 tokens"),
             ({"prompt": ["x"] * 65, "n": 2}, 400, "n", "130 choices")]
    for body, status, param, words in cases:
        with pytest.raises(openai.APIStatusError) as caught:
            await served.completions.create(model=MODEL, max_tokens=2, **body)
        error = caught.value
        assert (error.status_code, error.param) == (status, param), body
        assert words in error.message, error.message


async def test_the_rate_limit_charge_covers_every_prompt_and_fits_the_minute(cluster, make_router):
    await cluster.add_site("fra", 50.1, 8.7)
    router, url = await make_router()
    charged = []
    admit = router.fleet.admit

    async def recording_admit(key_id, requests_per_minute, tokens_per_minute, num_tokens):
        charged.append(num_tokens)
        return await admit(key_id, requests_per_minute, tokens_per_minute, num_tokens)

    router.fleet.admit = recording_admit
    batches = []
    for sampling in ({"max_tokens": 5}, {}):  # without max_tokens each choice may run to the context
        key = await cluster.create_key(tokens_per_minute=1000)
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
            batches.append(await client.completions.create(model=MODEL, prompt=PROMPTS, n=2, temperature=0,
                                                           **sampling))
    assert charged[0] == batches[0].usage.prompt_tokens + len(PROMPTS) * 2 * 5
    assert len(batches[1].choices) == 6 and charged[1] <= 1000  # the charge still fits the minute
    assert batches[1].usage.completion_tokens > 6 * 5
