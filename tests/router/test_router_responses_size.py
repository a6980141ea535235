"""/v1/responses holds the client's own body to max_body_bytes, not the chat request it is translated to: a
history of calls and results becomes longer chat messages (each call an assistant turn with `tool_calls`), and
a body within the limit is served although its translation is not."""

from __future__ import annotations

import json

import pytest
from router_fake_agent import MODEL

from node_agent.proto import agent_pb2
from router.responses import encode_json
from router.responses_api import translate

LIMIT = 4096


@pytest.fixture
async def served(cluster, make_router):
    info = agent_pb2.ModelInfo()
    info.CopyFrom(cluster.model_info)
    info.context_length = 8192  # the body's prompt fits: only its size is at stake
    cluster.model_info = info
    await cluster.add_site("fra", 50.1, 8.7)
    key = await cluster.create_key()
    _router, url = await make_router(max_body_bytes=LIMIT)
    return url, {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


def _body(size: int) -> bytes:
    """A Responses body of exactly `size` bytes: earlier calls and their results, then a question padded out."""
    items = []
    for i in range(12):
        items += [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": f"c{i}", "output": "x"}]
    document = {"model": MODEL, "max_output_tokens": 3, "input": [*items, {"role": "user", "content": ""}]}
    padding = size - len(json.dumps(document).encode())
    assert padding >= 0
    document["input"][-1]["content"] = "y" * padding
    body = json.dumps(document).encode()
    assert len(body) == size
    return body


async def test_a_body_within_the_limit_is_served_though_its_translation_is_longer(served, http):
    url, headers = served
    body = _body(LIMIT)
    chat, _request = translate(json.loads(body))
    assert len(encode_json(chat).encode()) > LIMIT  # what the chat handler reads is past the limit
    response = await http.post(f"{url}/v1/responses", content=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "response"


async def test_a_body_past_the_limit_is_413(served, http):
    url, headers = served
    response = await http.post(f"{url}/v1/responses", content=_body(LIMIT + 1), headers=headers)
    assert response.status_code == 413, response.text
    assert "exceeds 4096 bytes" in response.json()["error"]["message"]
