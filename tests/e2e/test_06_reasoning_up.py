"""A reasoning checkpoint served by `edgefire up` (registry, three agent processes, router), through
the official `openai` client: its thinking comes back as `reasoning_content`, apart from the answer,
streamed and not, and a follow-up turn replayed from the SDK's `model_dump()` works.

The checkpoint is the crafted Qwen3-template thinker of tests/router/test_router_reasoning_model.py:
random weights arranged so it writes `<think>` reasoning `</think>` answer; nothing is stubbed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import openai
import pytest

from deploy.launcher import Cluster
from tests.e2e.conftest import cluster_config
from tests.router.test_router_reasoning_model import ANSWER, MODEL, REASONING, _build_thinker


@pytest.fixture(scope="module")
def thinker_cluster(tmp_path_factory) -> Iterator[Cluster]:
    model_dir = _build_thinker(tmp_path_factory.mktemp("thinker") / MODEL)
    config = dataclasses.replace(cluster_config(model_dir, tmp_path_factory.mktemp("thinker-cluster")), model_name=MODEL)
    cluster = Cluster(config)
    cluster.start(timeout_s=120)
    yield cluster
    cluster.stop()


def test_reasoning_model_through_edgefire_up_returns_its_thinking_apart(thinker_cluster):
    num_reasoning_tokens = json.loads((thinker_cluster.config.model_dir / "thinker.json").read_text())[
        "num_reasoning_tokens"]
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    with openai.OpenAI(base_url=thinker_cluster.router_url + "/v1", api_key=thinker_cluster.api_key,
                       max_retries=0, http_client=thinker_cluster.http_client(timeout=60)) as client:
        completion = client.chat.completions.create(model=MODEL, messages=question, max_tokens=32)
        message = completion.choices[0].message
        assert message.model_extra["reasoning_content"] == REASONING.strip()
        assert message.content == ANSWER.strip()
        assert completion.usage.completion_tokens_details.reasoning_tokens == num_reasoning_tokens

        stream = client.chat.completions.create(model=MODEL, messages=question, max_tokens=32, stream=True,
                                                stream_options={"include_usage": True})
        reasoning, content, usage = [], [], None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                reasoning.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
                content.append(choice.delta.content or "")
        assert "".join(reasoning) == REASONING.strip() and "".join(content) == ANSWER.strip()
        assert usage.completion_tokens_details.reasoning_tokens == num_reasoning_tokens

        # The answer replayed as the SDK dumps it (None fields, reasoning_content) continues the chat.
        history = [*question, message.model_dump(), {"role": "user", "content": "And tomorrow?"}]
        follow_up = client.chat.completions.create(model=MODEL, messages=history, max_tokens=32)
        assert follow_up.choices[0].message.content == ANSWER.strip()
