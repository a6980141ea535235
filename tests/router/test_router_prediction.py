"""Predicted outputs and service tiers through the router, as an OpenAI client sees them.

A real in-process agent serves the demo checkpoint: a prediction never changes the greedy answer, a right
one is mostly kept (`accepted_prediction_tokens`) and takes the engine fewer steps, a wrong one is
rejected (`rejected_prediction_tokens`), on sites with speculation off or on; a stream cut mid-answer and
resumed on another site keeps its prediction. Bad shapes are 400s naming the field. Every service tier
is accepted and answered as "default", the one tier there is.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from engine.ngram import MAX_PREDICTION_TOKENS as SITE_MAX_PREDICTION_TOKENS
from engine.tokenizer import ChatTokenizer
from node_agent.proto import agent_pb2
from router.openai_request import MAX_PREDICTION_TOKENS
from tests.router.router_fake_agent import MODEL as FAKE
from tests.router.test_resume_stateful_streams import read_stream, sites
from tests.router.test_router_structured import DEMO, QUESTION, serving

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def plain_words(words) -> dict[str, float]:
    """A logit_bias that keeps the random model to whole words: an answer of them is text that encodes back
    to the tokens the model wrote (its own bytes are mostly not text, and a prediction is sent as text)."""
    return {str(token_id): 100.0 for token_id in words[:60]}


async def answer(client, engine, bias: dict, **fields) -> tuple[str, object, int]:
    """(text, usage, engine steps taken) of a greedy chat answer."""
    steps = engine.step_phases.num_steps
    completion = await client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=MAX_TOKENS,
                                                      temperature=0, logit_bias=bias, **fields)
    assert completion.service_tier == "default"
    return completion.choices[0].message.content, completion.usage, engine.step_phases.num_steps - steps


@pytest.mark.parametrize("speculation", [{}, {"speculative_method": "ngram"}], ids=["off", "ngram"])
async def test_a_prediction_never_changes_the_answer_and_reports_how_it_fared(cluster, make_router, tiny_model_dir,
                                                                              plain_words, speculation):
    async with serving(cluster, make_router, tiny_model_dir, DEMO, **speculation) as (client, engine):
        plain, usage, plain_steps = await answer(client, engine, plain_words)
        assert usage.completion_tokens_details is None  # no prediction, no prediction counts
        text, usage, steps = await answer(client, engine, plain_words, prediction={"type": "content", "content": plain})
        details = usage.completion_tokens_details
        assert text == plain and details.accepted_prediction_tokens > MAX_TOKENS // 2 and steps < plain_steps
        assert details.rejected_prediction_tokens == 0
        parts = [{"type": "text", "text": plain[:5]}, {"type": "text", "text": plain[5:]}]
        text, usage, _steps = await answer(client, engine, plain_words, prediction={"type": "content", "content": parts})
        assert text == plain and usage.completion_tokens_details.accepted_prediction_tokens > MAX_TOKENS // 2
        wrong = " ".join(reversed(plain.split())) + " and something else entirely"
        text, usage, _steps = await answer(client, engine, plain_words, prediction={"type": "content", "content": wrong})
        assert text == plain and usage.completion_tokens_details.rejected_prediction_tokens > 0
        # n > 1 and a stream: each choice verifies the prediction; the usage sums them
        stream = await client.chat.completions.create(
            model=DEMO, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0, logit_bias=plain_words, n=2, stream=True,
            stream_options={"include_usage": True}, prediction={"type": "content", "content": plain})
        chunks = [chunk async for chunk in stream]
        assert {chunk.service_tier for chunk in chunks} == {"default"}
        for index in (0, 1):
            assert "".join(c.choices[0].delta.content or "" for c in chunks
                           if c.choices and c.choices[0].index == index) == plain
        assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > MAX_TOKENS


async def test_a_stream_resumed_on_another_site_keeps_its_prediction(cluster, make_router, tiny_model_dir, plain_words,
                                                                    caplog):
    async with sites(cluster, make_router, tiny_model_dir, DEMO) as (url, key, cut):
        body = {"model": DEMO, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0,
                "logit_bias": plain_words}
        reference = await read_stream(url, key, body)
        body["prediction"] = {"type": "content", "content": reference["choices"][0]["content"]}
        after = 2
        cut.arm(after)
        with caplog.at_level(logging.WARNING, logger="router.generation"):
            resumed = await read_stream(url, key, body)
        assert f"failed (unavailable) after {after} token(s)" in caplog.text and cut.num_cuts == 1
        assert resumed["choices"] == reference["choices"]
        # the lost site sent `after` tokens, and kept at most k = 3 proposals past them: the rest is the resume's
        assert resumed["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > after + 3


BAD_PREDICTIONS = [
    ("x", "prediction"),
    ({"content": "x"}, "prediction.type"),
    ({"type": "text", "content": "x"}, "prediction.type"),
    ({"type": "content"}, "prediction.content"),
    ({"type": "content", "content": 5}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "prediction.content"),
    ({"type": "content", "content": [{"type": "text"}]}, "prediction.content"),
]


async def test_bad_predictions_and_service_tiers_are_400s_naming_the_field(cluster, make_router):
    await cluster.add_site("fra", 50.1, 8.7)
    _router, url = await make_router()
    key = await cluster.create_key()
    messages = [{"role": "user", "content": "x"}]
    prediction = {"type": "content", "content": "x"}
    async with httpx.AsyncClient(timeout=20, headers={"Authorization": f"Bearer {key}"}) as http:
        async def refused(body: dict, path: str = "chat/completions") -> dict:
            response = await http.post(f"{url}/v1/{path}", json={"model": FAKE, "max_tokens": 2, **body})
            assert response.status_code == 400, response.text
            return response.json()["error"]

        for value, param in BAD_PREDICTIONS:
            error = await refused({"messages": messages, "prediction": value})
            assert error["param"] == param, value
        combinations = [{"speculative": False}, {"response_format": {"type": "json_object"}},
                        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                         "tool_choice": "required"}]
        for change in combinations:
            error = await refused({"messages": messages, "prediction": prediction, **change})
            assert error["param"] == "prediction" and error["code"] == "invalid_parameter_combination", change
        error = await refused({"prompt": "x", "prediction": prediction}, "completions")  # chat only, as OpenAI's
        assert error["param"] == "prediction"
        error = await refused({"messages": messages, "service_tier": "turbo"})
        assert error["param"] == "service_tier"
        assert all(f'"{tier}"' in error["message"] for tier in ("auto", "default", "flex", "priority", "scale"))
        for tier in ("auto", "default", "flex", "priority", "scale"):
            response = await http.post(f"{url}/v1/chat/completions", json={
                "model": FAKE, "max_tokens": 2, "messages": messages, "service_tier": tier})
            assert response.status_code == 200 and response.json()["service_tier"] == "default", tier
        response = await http.post(f"{url}/v1/chat/completions", json={
            "model": FAKE, "max_tokens": 3, "messages": messages, "service_tier": "flex", "stream": True,
            "stream_options": {"include_usage": True}})
        events = [json.loads(line.removeprefix("data: ")) for line in response.text.split("\n\n")
                  if line.startswith("data: {")]
        assert len(events) > 2 and all(event["service_tier"] == "default" for event in events)


async def test_a_prediction_longer_than_a_site_takes_is_a_400_and_a_long_one_within_it_reaches_the_site(cluster,
                                                                                                      make_router):
    assert MAX_PREDICTION_TOKENS == SITE_MAX_PREDICTION_TOKENS  # the router refuses what a site would
    agent = await cluster.add_site("fra", 50.1, 8.7)
    info = agent_pb2.ModelInfo()
    info.CopyFrom(agent.info)
    info.context_length = 4 * MAX_PREDICTION_TOKENS  # the context is not what limits the prediction
    agent.info = info
    tokenizer = ChatTokenizer(info.tokenizer_json, json.loads(info.tokenizer_config_json))
    word = tokenizer.decode([cluster.words[0]])
    _router, url = await make_router()
    key = await cluster.create_key()
    messages = [{"role": "user", "content": "x"}]
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {key}"}) as http:
        too_long = word * (MAX_PREDICTION_TOKENS + 1)
        assert len(tokenizer.encode(too_long, False)) > MAX_PREDICTION_TOKENS
        response = await http.post(f"{url}/v1/chat/completions", json={
            "model": FAKE, "max_tokens": 2, "messages": messages,
            "prediction": {"type": "content", "content": too_long}})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "prediction.content" and f"at most {MAX_PREDICTION_TOKENS}" in error["message"]
        assert not [call for call, _request in agent.calls if call == "Generate"]
        long = word * (MAX_PREDICTION_TOKENS - 10)
        response = await http.post(f"{url}/v1/chat/completions", json={
            "model": FAKE, "max_tokens": 2, "messages": messages, "prediction": {"type": "content", "content": long}})
        assert response.status_code == 200, response.text
        (generate,) = [request for call, request in agent.calls if call == "Generate"]
        assert list(generate.sampling.prediction_ids) == tokenizer.encode(long, False)
