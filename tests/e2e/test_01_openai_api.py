"""The official `openai` client against the real stack, and client errors as OpenAI error bodies."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.e2e.conftest import prompt_ids

CHAT = [{"role": "system", "content": "You answer questions about the weather at the edge of the network."},
        {"role": "user", "content": "What is the weather like in Lisbon, Frankfurt and Warsaw today?"}]


@pytest.fixture
def client(cluster):
    with openai.OpenAI(base_url=cluster.router_url + "/v1", api_key=cluster.api_key, max_retries=0,
                       timeout=60.0) as client:
        yield client


def test_models_lists_the_served_model(client, cluster):
    assert [m.id for m in client.models.list().data] == [cluster.model]


def test_chat_streamed_equals_not_streamed(client, cluster):
    reply = client.chat.completions.create(model=cluster.model, messages=CHAT, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=cluster.model, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reply.choices[0].message.content == streamed
    assert reply.choices[0].finish_reason == [c for c in chunks if c.choices][-1].choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens <= 12
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens > 20


def test_multi_turn_with_sdk_dumped_turns_and_model_card(client, cluster):
    """Earlier assistant turns replayed as the SDK dumps them (None-valued fields) render as transformers
    renders the plain conversation; /v1/models says the context length."""
    from transformers import AutoTokenizer

    first = client.chat.completions.create(model=cluster.model, messages=CHAT, max_tokens=6, temperature=0)
    dumped = first.choices[0].message.model_dump()
    assert dumped["tool_calls"] is None and dumped["refusal"] is None
    history = [*CHAT, dumped, {"role": "user", "content": "And tomorrow?"}]
    second = client.chat.completions.create(model=cluster.model, messages=history, max_tokens=6, temperature=0)
    assert second.choices[0].message.content
    hf = AutoTokenizer.from_pretrained(str(cluster.config.model_dir))
    plain = [*CHAT, {"role": "assistant", "content": dumped["content"]}, history[-1]]
    assert second.usage.prompt_tokens == len(hf.apply_chat_template(plain, add_generation_prompt=True,
                                                                    return_dict=False))
    card = client.models.list().data[0]
    assert card.model_extra["max_model_len"] >= second.usage.prompt_tokens + 6 and card.owned_by == "edgefire"


def test_repeated_prompt_reports_cached_tokens(client, cluster):
    """The second time round the prefix cache holds the prompt: usage says how many tokens it skipped."""
    messages = [{"role": "system", "content": "Be brief. " * 30}, {"role": "user", "content": "Cache me."}]
    first = client.chat.completions.create(model=cluster.model, messages=messages, max_tokens=4, temperature=0)
    assert not (first.usage.prompt_tokens_details and first.usage.prompt_tokens_details.cached_tokens)
    cached = 0
    for _ in range(5):  # the router learns where the prefix is cached from the sites' next heartbeat
        time.sleep(1.2)
        chunks = list(client.chat.completions.create(model=cluster.model, messages=messages, max_tokens=4,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
        if cached:
            break
    assert 0 < cached < first.usage.prompt_tokens
    assert cached % 16 == 0  # whole KV blocks


def test_several_prompts_on_a_real_site_match_each_alone_and_echo(client, cluster):
    """Prompts batched into one request (n choices each, decoded side by side on the site) give what each
    gives alone; `echo` starts each choice with its prompt decoded as transformers decodes it."""
    from transformers import AutoTokenizer

    prompts = [prompt_ids(9), prompt_ids(14, start=3)]
    alone = [client.completions.create(model=cluster.model, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    batch = client.completions.create(model=cluster.model, prompt=prompts, n=2, max_tokens=6, temperature=0,
                                      echo=True)
    hf = AutoTokenizer.from_pretrained(str(cluster.config.model_dir))
    expected = [hf.decode(p) + a.choices[0].text for p, a in zip(prompts, alone) for _ in range(2)]
    assert [(c.index, c.text) for c in batch.choices] == list(enumerate(expected))
    assert batch.usage.prompt_tokens == 9 + 14
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)


def test_bad_keys_get_401_error_bodies(cluster):
    for key in ("ef-not-a-real-key-at-all", cluster.api_key[:-2]):
        bad = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as raised:
            bad.chat.completions.create(model=cluster.model, messages=CHAT, max_tokens=4)
        assert raised.value.status_code == 401
        assert raised.value.code == "invalid_api_key"
    response = httpx.post(cluster.router_url + "/v1/chat/completions", json={"model": cluster.model, "messages": CHAT})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("body, status, param", [
    ({"messages": CHAT, "temperature": 5}, 400, "temperature"),
    ({"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": CHAT, "max_tokens": 100_000}, 400, "max_tokens"),
    ({"messages": CHAT, "model": "no-such-model"}, 404, "model"),
])
def test_bad_input_gets_openai_error_bodies(http, cluster, body, status, param):
    response = http.post("/v1/chat/completions", json={"model": cluster.model, **body})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"] and error["type"] == "invalid_request_error"


def test_malformed_json_and_oversized_prompt(http, cluster):
    response = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
    response = http.post("/v1/completions", json={"model": cluster.model, "prompt": [70_000], "max_tokens": 2})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    # Nothing above reached a site: a well-formed request still works.
    ok = http.post("/v1/completions", json={"model": cluster.model, "prompt": prompt_ids(8), "max_tokens": 2})
    assert ok.status_code == 200


def test_embeddings_through_the_whole_stack_equal_transformers(client, cluster):
    """`edgefire up`'s sites embed through the router as transformers' model does (last token, normalized)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    texts = ["the weather in Lisbon", "edge"]
    answer = client.embeddings.create(model=cluster.model, input=texts)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(cluster.config.model_dir))
    model = AutoModel.from_pretrained(str(cluster.config.model_dir), dtype=torch.float32).eval()
    for datum, text in zip(answer.data, texts):
        ids = hf_tokenizer(text)["input_ids"]   # with its special tokens, as sentence-transformers encodes
        with torch.no_grad():
            expected = torch.nn.functional.normalize(model(torch.tensor([ids])).last_hidden_state[0, -1], dim=0)
        torch.testing.assert_close(torch.tensor(datum.embedding), expected, atol=2e-5, rtol=1e-4)
    assert answer.usage.prompt_tokens > 2
