"""Malformed bodies from a client with a valid key: each is a 400 in the OpenAI error shape that names
the field where one can be named, never a 500 (issue 17, defect 3)."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest
from router_fake_agent import MODEL
from test_router_errors import assert_openai_error

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def served(cluster, make_router):
    await cluster.add_site("fra", 50.1, 8.7)
    key = await cluster.create_key()
    _router, url = await make_router(max_body_bytes=1 << 20)
    return url, {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 2, **fields}


def tool_call(arguments: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": arguments}}]}


ARGUMENTS = "messages[0].tool_calls[0].function.arguments"


def splice(body: dict, name: str, raw: str) -> bytes:
    """`body` as JSON with the value of `name` replaced by raw JSON text (what no encoder would write)."""
    return json.dumps({**body, name: "@@"}).replace('"@@"', raw).encode()


# (path, raw body, param the error must name; None where the parser cannot know the field)
MALFORMED = [
    ("chat", f'{{"model": "{MODEL}", "messages": '.encode() + b"[" * 60_000 + b"]" * 60_000 + b"}", None),
    ("chat", splice(chat(), "max_tokens", "9" * 5000), None),
    ("chat", splice(chat(), "seed", "-" + "1" * 5000), None),
    ("chat", splice(chat(), "messages", '[{"role": "user", "content": "a\\ud800b"}]'), "messages[0].content"),
    ("chat", splice(chat(), "messages", '[{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]'),
     "messages[0].content"),
    ("chat", splice(chat(), "messages", '[{"role": "user", "content": "hi", "name": "\\ud83d"}]'),
     "messages[0].name"),
    ("completions", splice({"model": MODEL, "max_tokens": 2}, "prompt", '"x\\udc00"'), "prompt"),
    ("completions", splice({"model": MODEL, "max_tokens": 2}, "prompt", '["\\ud800"]'), "prompt"),
    ("completions", json.dumps({"model": MODEL, "prompt": "@@"}).encode().replace(b"@@", b"\xed\xa0\x80"),
     "prompt"),  # a surrogate written as raw UTF-8 bytes
    ("chat", splice(chat(), "model", '"tiny\\ud800"'), "model"),
    ("chat", splice(chat(), "stop", '["\\ud800"]'), "stop"),
    ("chat", splice(chat(), "user", '"\\ud800"'), "user"),
    ("chat", json.dumps(chat(seed=2 ** 64)).encode(), "seed"),
    ("chat", json.dumps(chat(seed=2 ** 63)).encode(), "seed"),  # past what an engine takes (engine.sampling)
    ("chat", json.dumps(chat(seed=10 ** 100)).encode(), "seed"),
    ("chat", splice(chat(), "temperature", "NaN"), "temperature"),
    ("chat", splice(chat(), "top_p", "Infinity"), "top_p"),
    ("chat", splice(chat(), "temperature", "1e400"), "temperature"),
    ("chat", splice(chat(), "seed", "1e400"), "seed"),
    ("chat", splice(chat(), "max_tokens", "-Infinity"), "max_tokens"),
    ("chat", json.dumps(chat(model=["tiny"])).encode(), "model"),
    ("chat", json.dumps(chat(model={"id": "tiny"})).encode(), "model"),
    ("chat", json.dumps(chat(messages="hi")).encode(), "messages"),
    ("chat", json.dumps(chat(messages=[{"role": ["user"], "content": "hi"}])).encode(), "messages[0].role"),
    ("chat", json.dumps(chat(messages=[{"role": "user", "content": {"text": "hi"}}])).encode(),
     "messages[0].content"),
    ("chat", json.dumps(chat(messages=[{"role": "user", "content": [{"type": "text", "text": ["hi"]}]}])).encode(),
     "messages[0].content"),
    ("chat", json.dumps(chat(stop=[1])).encode(), "stop"),
    ("chat", json.dumps(chat(stop={"a": 1})).encode(), "stop"),
    ("chat", json.dumps(chat(user=["u"])).encode(), "user"),
    ("chat", json.dumps(chat(stream="yes")).encode(), "stream"),
    ("chat", json.dumps(chat(stream=True, stream_options=[1])).encode(), "stream_options"),
    ("chat", json.dumps(chat(logprobs=True, top_logprobs=10 ** 30)).encode(), "top_logprobs"),
    ("chat", json.dumps(chat(max_tokens=2 ** 70)).encode(), "max_tokens"),
    ("chat", json.dumps(chat(top_k=2 ** 40)).encode(), "top_k"),
    ("chat", json.dumps(chat(repetition_penalty="1")).encode(), "repetition_penalty"),
    ("chat", json.dumps(chat(speculative="no")).encode(), "speculative"),
    ("chat", splice(chat(), "tools", '[{"type": "function", "function": {"name": "f\\ud800"}}]'), "tools[0].function"),
    ("chat", json.dumps(chat(tools="f")).encode(), "tools"),
    # OpenAI's custom (free-text) tools are not functions: never read as one
    ("chat", json.dumps(chat(tools=[{"type": "custom", "custom": {"name": "grep"}}])).encode(), "tools[0].type"),
    ("chat", json.dumps(chat(tools=[{"type": "function", "function": {"name": "f"}},
                                    {"type": "function", "function": {"name": 3}}])).encode(), "tools[1]"),
    # Tool-call arguments are JSON inside a string: the same limits apply to what the router decodes there.
    ("chat", json.dumps(chat(messages=[tool_call("[" * 5000 + "]" * 5000)])).encode(), ARGUMENTS),
    ("chat", json.dumps(chat(messages=[tool_call("1" * 5000)])).encode(), ARGUMENTS),
    ("chat", json.dumps(chat(messages=[tool_call('{"a": "\\ud800"}')])).encode(), ARGUMENTS),
    ("chat", json.dumps(chat(messages=[tool_call("{nope")])).encode(), ARGUMENTS),
    ("chat", json.dumps(chat(chat_template_kwargs=[1])).encode(), "chat_template_kwargs"),
    ("chat", json.dumps(chat(max_completion_tokens=[3])).encode(), "max_completion_tokens"),
    ("completions", json.dumps({"model": MODEL, "prompt": [1, 2 ** 64]}).encode(), "prompt"),
    ("completions", json.dumps({"model": MODEL, "prompt": [[1, 2], [1, 2 ** 64]]}).encode(), "prompt[1]"),
    ("completions", json.dumps({"model": MODEL, "prompt": ["x", [1, -2]]}).encode(), "prompt[1]"),
    ("completions", json.dumps({"model": MODEL, "prompt": "x", "echo": "yes"}).encode(), "echo"),
    ("completions", json.dumps({"model": MODEL, "prompt": "x", "logprobs": 2 ** 64}).encode(), "logprobs"),
    ("completions", json.dumps({"model": MODEL, "prompt": "x", "echo": True, "n": 2 ** 64}).encode(), "n"),
]


async def test_malformed_bodies_are_400s_naming_the_field(served, http):
    url, headers = served
    wrong = []
    for endpoint, body, param in MALFORMED:
        response = await http.post(f"{url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}",
                                   content=body, headers=headers)
        try:
            error = assert_openai_error(response, 400, param)
            assert error["type"] == "invalid_request_error"
        except (AssertionError, ValueError):
            wrong.append((body[:100], response.status_code, response.text[:200]))
    assert not wrong, "\n".join(map(repr, wrong))
    # What is valid at the edges is still served.
    response = await http.post(f"{url}/v1/chat/completions", json=chat(seed=2 ** 63 - 1), headers=headers)
    assert response.status_code == 200, response.text
    response = await http.post(f"{url}/v1/chat/completions", json=chat(user=""), headers=headers)
    assert response.status_code == 200, response.text
    response = await http.post(f"{url}/v1/chat/completions", json=chat(user=5), headers=headers)
    assert assert_openai_error(response, 400, "user")["message"] == "`user` must be a string."  # "" is served
    # "\\ud800" in JSON is a backslash and five letters, not a surrogate.
    body = splice(chat(), "messages", '[{"role": "user", "content": "path C:\\\\ud800"}]')
    response = await http.post(f"{url}/v1/chat/completions", content=body, headers=headers)
    assert response.status_code == 200, response.text


async def test_a_compressed_body_is_a_415_naming_the_encoding(served, http):
    url, headers = served
    for encoding, compress in (("gzip", gzip.compress), ("deflate", zlib.compress)):
        response = await http.post(f"{url}/v1/chat/completions", content=compress(json.dumps(chat()).encode()),
                                   headers={**headers, "Content-Encoding": encoding})
        error = assert_openai_error(response, 415)
        assert error["code"] == "unsupported_content_encoding" and f"`{encoding}`" in error["message"]
    response = await http.post(f"{url}/v1/chat/completions", content=json.dumps(chat()).encode(),
                               headers={**headers, "Content-Encoding": "identity"})
    assert response.status_code == 200, response.text


def test_an_error_quoting_unencodable_client_text_is_still_an_openai_body():
    # The parser refuses lone surrogates before any error can quote one; this is the belt under
    # those braces: a message holding one (a model name in a 404) used to become a plain-text 500.
    from router.app import _error_response
    from router.errors import unknown_model

    response = _error_response(unknown_model("tiny\ud800"))
    assert response.status_code == 404
    assert json.loads(response.body)["error"]["code"] == "model_not_found"


def test_speculative_false_reaches_the_site_as_an_opt_out():
    from types import SimpleNamespace

    from router.completions import sampling_params
    from router.model_assets import SamplingDefaults
    from router.openai_request import parse_request

    assets = SimpleNamespace(sampling_defaults=SamplingDefaults(), eos_token_ids=[2])
    for fields, opted_out in (({"speculative": False}, True), ({"speculative": True}, False), ({}, False)):
        request = parse_request(chat(**fields), chat=True)
        assert sampling_params(request, assets, 2).no_speculation is opted_out


def test_every_choice_of_a_seeded_request_reaches_the_engine_with_a_seed_it_takes():
    """The largest seed the router accepts, with n > 1 (choice i draws with seed + i): no choice may carry
    a seed the engine refuses, which the client would see as a site rejecting its request."""
    from types import SimpleNamespace

    from engine.sampling import SamplingParams
    from router.completions import sampling_params
    from router.model_assets import SamplingDefaults
    from router.openai_request import parse_request

    assets = SimpleNamespace(sampling_defaults=SamplingDefaults(), eos_token_ids=[2])
    request = parse_request(chat(seed=2 ** 63 - 1, n=3), chat=True)
    seeds = [sampling_params(request, assets, 2, index=i).seed for i in range(3)]
    assert len(set(seeds)) == 3  # the choices still draw differently
    for seed in seeds:
        SamplingParams(seed=seed).validate(vocab_size=10)
