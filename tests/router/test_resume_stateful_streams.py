"""A stream whose site dies mid-answer is resumed on another site (prompt + tokens so far) and must read,
to the client, exactly as an unbroken run: the same text, tool calls, reasoning, logprobs, finish reason
and usage, for the features whose state spans the stream (grammars, tool calls, reasoning, stop strings,
seeded sampling, n > 1).

Real in-process agents serve the same random-weight checkpoint behind one router, colocated (two sites
that do both) or split (one prefill site, two decode sites). `Cut` loses a site once a stream on it has
sent a chosen number of tokens: its streams end with UNAVAILABLE, as a dead site's do, and the router
resumes each on another site. The same request without the cut is the reference, and the router's log
shows the cut was a resume after exactly that many tokens, not a fresh start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging

import httpx
import pytest

from node_agent.config import AgentConfig
from node_agent.daemon import Agent
from node_agent.errors import DrainingError
from tests.router.test_router_reasoning_model import MODEL as THINKER, _build_thinker
from tests.router.test_router_structured import ADD, MODEL as QWEN, PEER_TOKEN, QUESTION, WEATHER, _build

# name: (lat, lon, role). Colocated: either site runs the whole request. Split: oslo prefills, and the
# decode site that is cut is replaced by the other one.
COLOCATED = {"oslo": (59.9, 10.7, "both"), "bergen": (60.4, 5.3, "both")}
SPLIT = {"oslo": (59.9, 10.7, "prefill"), "bergen": (60.4, 5.3, "decode"), "trondheim": (63.4, 10.4, "decode")}


class Cut:
    """Loses a site mid-stream: once armed with `arm(after)`, the first stream (Generate or Decode) started
    since whose output reaches `after` tokens (counting those it was given to resume from, or to decode
    after a prefill) ends there with UNAVAILABLE, and so does every other stream of its site at its next
    token, and every call the site gets after, until `revive()`."""

    def __init__(self) -> None:
        self.after: int | None = None
        self.num_cuts = 0
        self.dead: set[str] = set()
        self._epoch = 0   # streams started before the last arm (an earlier request's, ending) never cut

    def arm(self, after: int) -> None:
        self.after, self._epoch = after, self._epoch + 1

    def revive(self) -> None:
        self.after = None
        self.dead.clear()

    def wrap(self, site: str, stream):
        async def cut_stream(model, prompt_ids, generated_ids, *args, **kwargs):
            epoch, num_tokens = self._epoch, len(generated_ids)
            self._check(site)
            async for event in stream(model, prompt_ids, generated_ids, *args, **kwargs):
                self._check(site)
                num_tokens += 1
                if epoch == self._epoch and self.after is not None and num_tokens >= self.after \
                        and not event.finish_reason:
                    self.after = None
                    self.num_cuts += 1
                    self.dead.add(site)
                    event = dataclasses.replace(event, more=False)  # sent at once: the router has `after` tokens
                yield event
        return cut_stream

    def _check(self, site: str) -> None:
        if site in self.dead:
            raise DrainingError(f"site {site} was lost")  # UNAVAILABLE, as a dead site's stream ends


@contextlib.asynccontextmanager
async def sites(cluster, make_router, directory, model: str, layout: dict = COLOCATED):
    """(router url, API key, Cut) with agents serving `directory` as `layout` places them."""
    cut, agents = Cut(), []
    try:
        for name, (lat, lon, role) in layout.items():
            agent = Agent(AgentConfig(site=name, models={model: str(directory)}, grpc_listen="127.0.0.1:0",
                                      metrics_listen=None, peer_token=PEER_TOKEN, kv_cache_bytes=8 << 20,
                                      device="cpu", dtype="float32"))
            await agent.start()
            agents.append(agent)
            agent.core.generate = cut.wrap(name, agent.core.generate)
            agent.core.decode = cut.wrap(name, agent.core.decode)
            await cluster.admin.create_site(name, region="eu", country="NO", lat=lat, lon=lon,
                                            grpc_address=agent.address, models=[{"model": model, "role": role}],
                                            heartbeat_interval_s=60)
            await cluster.heartbeat(name)
        key = await cluster.create_key()
        _router, url = await make_router(peer_token=PEER_TOKEN, first_token_timeout_s=60, token_idle_timeout_s=60,
                                         cooldown_s=0.0)
        yield url, key, cut
    finally:
        for agent in agents:
            await agent.stop()


@pytest.fixture(params=[COLOCATED, SPLIT], ids=["colocated", "split"])
def layout(request) -> dict:
    return request.param


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("qwen-noise"))


@pytest.fixture(scope="module")
def thinker_dir(tmp_path_factory):
    return _build_thinker(tmp_path_factory.mktemp("thinker") / THINKER)


async def read_stream(url: str, key: str, body: dict) -> dict:
    """What a client makes of a chat stream: per choice its content, reasoning, tool calls (joined),
    logprobs and finish reason; and the usage."""
    choices: dict[int, dict] = {}
    usage = None
    async with httpx.AsyncClient(timeout=120) as http, http.stream(
            "POST", f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
            json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200, await response.aread()
        sites_used = (response.headers["x-edgefire-prefill-site"], response.headers["x-edgefire-decode-site"])
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                seen = choices.setdefault(choice["index"], {"content": "", "reasoning": "", "calls": {},
                                                            "logprobs": [], "finish_reason": None})
                delta = choice["delta"]
                seen["content"] += delta.get("content") or ""
                seen["reasoning"] += delta.get("reasoning_content") or ""
                for call in delta.get("tool_calls") or ():
                    joined = seen["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                    joined["name"] += call.get("function", {}).get("name") or ""
                    joined["arguments"] += call.get("function", {}).get("arguments") or ""
                if choice.get("logprobs"):
                    seen["logprobs"] += [(lp["token"], round(lp["logprob"], 3))
                                         for lp in choice["logprobs"]["content"]]
                seen["finish_reason"] = choice["finish_reason"] or seen["finish_reason"]
    return {"choices": choices, "usage": usage, "sites": sites_used}


async def assert_resumes_unbroken(url: str, key: str, cut: Cut, body: dict, layout: dict, cut_points,
                                  caplog: pytest.LogCaptureFixture) -> dict:
    """The reference stream, after checking that the same request cut after each of `cut_points` tokens
    (then resumed on another site) reads the same."""
    reference = await read_stream(url, key, body)
    split = reference["sites"][0] != reference["sites"][1]
    assert split == (layout is SPLIT)
    assert max(cut_points) < reference["usage"]["completion_tokens"]
    for after in cut_points:
        num_cuts = cut.num_cuts
        cut.arm(after)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="router.generation"):
            resumed = await read_stream(url, key, body)
        cut.revive()  # the lost site is back for the next request
        assert f"failed (unavailable) after {after} token(s)" in caplog.text  # a resume, not a fresh start
        assert cut.num_cuts == num_cuts + 1, f"no stream reached {after} tokens"
        assert resumed["choices"] == reference["choices"], f"cut after {after} token(s)"
        assert resumed["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]
        assert resumed["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    return reference


async def test_required_tool_call_cut_mid_arguments_resumes_into_the_same_call(cluster, make_router, qwen_dir, layout,
                                                                               caplog):
    async with sites(cluster, make_router, qwen_dir, QWEN, layout) as (url, key, cut):
        body = {"model": QWEN, "messages": QUESTION, "tools": [WEATHER, ADD], "tool_choice": "required",
                "parallel_tool_calls": False, "seed": 11, "temperature": 1.0, "max_tokens": 120, "logprobs": True}
        reference = await assert_resumes_unbroken(url, key, cut, body, layout, (2, 3, 9, 30), caplog)
        choice = reference["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert all(json.loads(call["arguments"]) is not None for call in choice["calls"].values())


async def test_json_schema_answer_cut_mid_object_resumes_valid(cluster, make_router, qwen_dir, layout, caplog):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
              "properties": {"city": {"type": "string", "maxLength": 8},
                             "days": {"type": "array", "minItems": 4, "maxItems": 4,
                                      "items": {"type": "integer", "minimum": 0, "maximum": 99}}}}
    async with sites(cluster, make_router, qwen_dir, QWEN, layout) as (url, key, cut):
        body = {"model": QWEN, "messages": QUESTION, "seed": 5, "temperature": 1.0, "max_tokens": 120,
                "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}
        reference = await assert_resumes_unbroken(url, key, cut, body, layout, (2, 7), caplog)
        assert reference["choices"][0]["finish_reason"] == "stop"
        json.loads(reference["choices"][0]["content"])


async def test_strict_tools_under_auto_cut_mid_stream(cluster, make_router, qwen_dir, layout, caplog):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    async with sites(cluster, make_router, qwen_dir, QWEN, layout) as (url, key, cut):
        body = {"model": QWEN, "messages": QUESTION, "tools": [strict], "tool_choice": "auto",
                "parallel_tool_calls": False, "seed": 4, "temperature": 1.0, "max_tokens": 80, "logprobs": True,
                "top_logprobs": 2}
        reference = await assert_resumes_unbroken(url, key, cut, body, layout, (2, 16, 24, 40), caplog)
        choice = reference["choices"][0]
        assert choice["content"] and choice["finish_reason"] == "tool_calls"  # words, then a call


async def test_seeded_choices_one_cut_each_equals_unbroken(cluster, make_router, qwen_dir, layout, caplog):
    async with sites(cluster, make_router, qwen_dir, QWEN, layout) as (url, key, cut):
        body = {"model": QWEN, "messages": QUESTION, "n": 3, "seed": 8, "temperature": 1.0, "max_tokens": 24,
                "frequency_penalty": 0.7, "presence_penalty": 0.3}
        await assert_resumes_unbroken(url, key, cut, body, layout, (2, 5, 12), caplog)


async def test_stop_string_held_back_across_the_cut(cluster, make_router, qwen_dir, layout, caplog):
    async with sites(cluster, make_router, qwen_dir, QWEN, layout) as (url, key, cut):
        body = {"model": QWEN, "messages": QUESTION, "seed": 21, "temperature": 1.0, "max_tokens": 30}
        text = (await read_stream(url, key, body))["choices"][0]["content"]
        stop = text[len(text) // 2:len(text) // 2 + 6]
        body["stop"] = [stop, stop[:3] + "\u00ff"]  # the second one's prefix is held back, then released
        reference = await assert_resumes_unbroken(url, key, cut, body, layout, (3, 8, 14), caplog)
        assert reference["choices"][0]["finish_reason"] == "stop"


async def test_reasoning_cut_inside_and_after_the_block(cluster, make_router, thinker_dir, layout, caplog):
    async with sites(cluster, make_router, thinker_dir, THINKER, layout) as (url, key, cut):
        body = {"model": THINKER, "messages": QUESTION, "seed": 2, "max_tokens": 32}
        reference = await assert_resumes_unbroken(url, key, cut, body, layout, (2, 3, 5, 6, 8), caplog)
        assert reference["choices"][0]["reasoning"] and reference["choices"][0]["content"]


async def test_reasoning_with_schema_cut_inside_and_after_the_block(cluster, make_router, thinker_dir, layout, caplog):
    async with sites(cluster, make_router, thinker_dir, THINKER, layout) as (url, key, cut):
        schema = {"type": "object", "required": ["ok"], "additionalProperties": False,
                  "properties": {"ok": {"type": "boolean"}}}
        body = {"model": THINKER, "messages": QUESTION, "seed": 2, "max_tokens": 40,
                "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
        reference = await assert_resumes_unbroken(url, key, cut, body, layout, (2, 5, 7), caplog)
        json.loads(reference["choices"][0]["content"])


async def test_reasoning_then_required_call_cut_in_either(cluster, make_router, thinker_dir, layout, caplog):
    async with sites(cluster, make_router, thinker_dir, THINKER, layout) as (url, key, cut):
        body = {"model": THINKER, "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required",
                "parallel_tool_calls": False, "seed": 6, "max_tokens": 80}
        reference = await assert_resumes_unbroken(url, key, cut, body, layout, (2, 6, 12, 20), caplog)
        choice = reference["choices"][0]
        assert choice["reasoning"] and choice["finish_reason"] == "tool_calls"
        json.loads(choice["calls"][0]["arguments"])


async def test_length_finish_right_after_the_cut(cluster, make_router, qwen_dir, layout, caplog):
    async with sites(cluster, make_router, qwen_dir, QWEN, layout) as (url, key, cut):
        body = {"model": QWEN, "messages": QUESTION, "seed": 9, "temperature": 1.0, "max_tokens": 6,
                "logprobs": True, "top_logprobs": 3}
        reference = await assert_resumes_unbroken(url, key, cut, body, layout, (5,), caplog)
        assert reference["choices"][0]["finish_reason"] == "length"
