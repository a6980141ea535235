"""A real engine behind the router, through the official `openai` client: a reasoning checkpoint's
thinking comes back as `reasoning_content`, streamed and not; its generation_config's temperature is
what a request without one samples with; an SDK-replayed multi-turn conversation works.

The checkpoint is the demo Llama with random weights, a tokenizer carrying Qwen3's control tokens
and Qwen3's published chat template. Its weights are crafted so the model thinks: the layers'
output projections are scaled down to nothing, making it a bigram model, and a handful of tokens
get orthogonal embeddings (dimensions no other token uses) whose unembedding rows point at the next token of a fixed sentence, so
after Qwen3's generation prompt ("...<|im_start|>assistant\\n") it writes
`<think>` reasoning `</think>` answer `<|im_end|>`. Every other token keeps random logits, so
sampling stays random there. Nothing on the serving path is stubbed.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch
from safetensors.torch import save_file

from engine.demo import SIZES, make_demo_model, random_weights
from node_agent.config import AgentConfig
from node_agent.daemon import Agent
from tests.engine.chat_checkpoints import CONTROL_TOKEN, template_text, train_tokenizer

MODEL = "thinker"
PEER_TOKEN = "peer-secret"
REASONING = "Snow in Oslo"   # no token of the reasoning and the answer may repeat: the model is a bigram
ANSWER = " weather today"
TEMPERATURE = 0.6


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def _build_thinker(directory):
    make_demo_model(directory, size="tiny")  # config and layout; tokenizer and weights replaced below
    template = template_text("Qwen-Qwen3-0.6B")
    control = sorted(set(CONTROL_TOKEN.findall(template)))
    tokenizer = train_tokenizer(control, vocab_size=512, extra_text=f"\n{REASONING}\n{ANSWER}\n")
    tokenizer.save(str(directory / "tokenizer.json"))
    token = tokenizer.token_to_id
    chain = [token("Ċ"), token("<think>"), *_ids(tokenizer, REASONING), token("</think>"), *_ids(tokenizer, ANSWER),
             token("<|im_end|>")]
    assert None not in chain and len(set(chain)) == len(chain)
    shape, vocab_size = SIZES["tiny"], tokenizer.get_vocab_size(with_added_tokens=True)
    head_dim = shape.hidden_size // shape.num_heads
    weights = random_weights(shape, vocab_size, head_dim, seed=3)
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] *= 1e-4
    embed, unembed = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    embed[:, :len(chain)] = 0  # the sentence's own dimensions: only its tokens point along them
    for i, (current, following) in enumerate(zip(chain, chain[1:])):
        embed[current] = torch.nn.functional.one_hot(torch.tensor(i), shape.hidden_size).float()
        unembed[following] += 12.0 * embed[current]
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config.update(vocab_size=vocab_size, bos_token_id=None, eos_token_id=token("<|im_end|>"))
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [token("<|im_end|>")], "temperature": TEMPERATURE}))
    # for the tests: how many tokens the reasoning takes, and which tokens the crafted sentence uses
    (directory / "thinker.json").write_text(json.dumps({"num_reasoning_tokens": len(_ids(tokenizer, REASONING)) + 2,
                                                        "chain": chain}))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>" if token("<|endoftext|>") else None,
         "chat_template": template}))
    return directory


@pytest.fixture
def thinker_dir(tmp_path):
    return _build_thinker(tmp_path / "thinker")


@pytest.fixture
async def client(cluster, make_router, thinker_dir):
    model_dir = thinker_dir
    agent = Agent(AgentConfig(site="oslo", models={MODEL: str(model_dir)}, grpc_listen="127.0.0.1:0",
                              metrics_listen=None, peer_token=PEER_TOKEN, kv_cache_bytes=4 << 20, device="cpu",
                              dtype="float32"))
    await agent.start()
    try:
        await cluster.admin.create_site("oslo", region="eu", country="NO", lat=59.9, lon=10.7,
                                        grpc_address=agent.address, models=[{"model": MODEL, "role": "both"}],
                                        heartbeat_interval_s=60)
        await cluster.heartbeat("oslo")
        key = await cluster.create_key()
        _router, url = await make_router(peer_token=PEER_TOKEN)
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
            yield client
    finally:
        await agent.stop()


async def test_reasoning_checkpoint_returns_its_thinking_apart(client, thinker_dir):
    num_reasoning_tokens = json.loads((thinker_dir / "thinker.json").read_text())["num_reasoning_tokens"]
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    completion = await client.chat.completions.create(model=MODEL, messages=question, max_tokens=32)
    message = completion.choices[0].message
    assert message.model_extra["reasoning_content"] == REASONING.strip()
    assert message.content == ANSWER.strip()
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens_details.reasoning_tokens == num_reasoning_tokens

    stream = await client.chat.completions.create(model=MODEL, messages=question, max_tokens=32, stream=True,
                                                  stream_options={"include_usage": True})
    reasoning, content, usage = [], [], None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
            content.append(choice.delta.content or "")
    assert "".join(reasoning) == REASONING.strip() and "".join(content) == ANSWER.strip()
    assert usage.completion_tokens_details.reasoning_tokens == num_reasoning_tokens

    # The answer, replayed as the SDK dumps it (None fields, reasoning_content), continues the conversation.
    history = [*question, message.model_dump(), {"role": "user", "content": "And tomorrow?"}]
    follow_up = await client.chat.completions.create(model=MODEL, messages=history, max_tokens=32)
    assert follow_up.choices[0].message.content == ANSWER.strip()
    assert follow_up.usage.prompt_tokens > completion.usage.prompt_tokens + 10

    switched_off = await client.chat.completions.create(model=MODEL, messages=question, max_tokens=32,
                                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert switched_off.usage.prompt_tokens > completion.usage.prompt_tokens  # the empty think block


async def test_generation_config_temperature_applies_when_the_request_omits_it(client, thinker_dir):
    chain = set(json.loads((thinker_dir / "thinker.json").read_text())["chain"])
    prompt = [i for i in range(30, 400, 7) if i not in chain][:12]  # random logits: sampling is random

    async def sample(**fields) -> str:
        completion = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, seed=11, **fields)
        return completion.choices[0].text

    default = await sample()
    assert default == await sample(temperature=TEMPERATURE)
    assert default != await sample(temperature=1.0)
    assert default != await sample(temperature=0)
