"""A tool call whose decode site is killed (SIGKILL) while the call is being written, through real
processes: the router resumes it on another site, and the client gets the same call, finish reason and
usage as an undisturbed run with the same seed.

The checkpoint is the Qwen2.5-templated noise model of tests/router/test_router_structured.py: whatever
parses here does so because the tool-call grammar, rebuilt on the resuming site from the tokens already
sent, held. tests/router/test_resume_stateful_streams.py cuts streams at chosen tokens for the other
features whose state spans a stream (reasoning, stop strings, logprobs, n > 1).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator

import jsonschema
import pytest

from deploy.launcher import Cluster
from tests.e2e.conftest import cluster_config, router_client, router_log
from tests.router.test_router_structured import MODEL, QUESTION, _build

# Long arguments (30 numbers), so a kill lands while the call is being written.
READINGS = {"type": "object", "additionalProperties": False, "required": ["readings"],
            "properties": {"readings": {"type": "array", "minItems": 30, "maxItems": 30,
                                        "items": {"type": "integer", "minimum": 0, "maximum": 999}}}}
LOG_TOOL = {"type": "function", "function": {"name": "log_readings", "parameters": READINGS}}
BODY = {"model": MODEL, "messages": QUESTION, "tools": [LOG_TOOL], "tool_choice": "required",
        "parallel_tool_calls": False, "seed": 7, "temperature": 1.0, "max_tokens": 300, "stream": True,
        "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def qwen_cluster(tmp_path_factory) -> Iterator[Cluster]:
    model_dir = _build(tmp_path_factory.mktemp("qwen-noise") / MODEL)
    # Two sites doing both roles: the one a kill leaves is where the call resumes (each agent started costs
    # seconds of CPU).
    config = cluster_config(model_dir, tmp_path_factory.mktemp("qwen-cluster"))
    sites = [dataclasses.replace(site, role="both") for site in config.sites[:2]]
    config = dataclasses.replace(config, model_name=MODEL, sites=sites)
    cluster = Cluster(config)
    cluster.start(timeout_s=120)
    yield cluster
    cluster.stop()


def stream_call(http, on_first_event=None) -> tuple[list[dict], str | None, dict, dict]:
    """(the calls joined from their deltas, finish_reason, usage, headers) of one streamed request."""
    calls: dict[int, dict] = {}
    finish, usage = None, None
    with http.stream("POST", "/v1/chat/completions", json=BODY) as response:
        assert response.status_code == 200, response.read()
        headers = dict(response.headers)
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if on_first_event is not None:
                on_first_event(headers)
                on_first_event = None
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                for delta in choice["delta"].get("tool_calls") or ():
                    call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
                    call["name"] += delta.get("function", {}).get("name") or ""
                    call["arguments"] += delta.get("function", {}).get("arguments") or ""
                finish = choice["finish_reason"] or finish
    return [calls[i] for i in sorted(calls)], finish, usage, headers


def test_tool_call_whose_decode_site_is_killed_resumes_into_the_same_call(qwen_cluster):
    with router_client(qwen_cluster) as http:
        reference, reference_finish, reference_usage, _ = stream_call(http)
        assert reference_finish == "tool_calls" and [c["name"] for c in reference] == ["log_readings"]
        jsonschema.validate(json.loads(reference[0]["arguments"]), READINGS)
        resumed_after = None
        # On a loaded machine the site can finish the call before the kill lands; then the killed site is
        # started again and the kill tried on a fresh request.
        killed: list[str] = []
        for _attempt in range(3):
            for site in killed:
                qwen_cluster.start_site(site)
            killed.clear()

            def kill_decode_site(headers) -> None:
                killed.append(headers["x-edgefire-decode-site"])
                qwen_cluster.kill_site(killed[0])

            calls, finish, usage, headers = stream_call(http, on_first_event=kill_decode_site)
            assert calls == reference and finish == "tool_calls"
            assert usage["completion_tokens"] == reference_usage["completion_tokens"]
            assert usage["prompt_tokens"] == reference_usage["prompt_tokens"]
            failure = re.search(rf"request {headers['x-request-id']}: site {killed[0]} failed \(\w+\) after (\d+) "
                                rf"token", router_log(qwen_cluster))
            if failure is not None:
                resumed_after = int(failure.group(1))
                break
        assert resumed_after is not None and 0 < resumed_after < reference_usage["completion_tokens"]
