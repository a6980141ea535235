"""Structured output, tool calls, penalties and n > 1 through the official `openai` client, against a
router and a real engine (an in-process agent) on random-weight checkpoints whose free output is
noise: whatever parses and validates here does so because of the grammar.

The schemas run on the tiny demo model itself. Tools run on the same architecture with a tokenizer
carrying Qwen2.5's control tokens and Qwen2.5's published chat template, so tools reach the model
through the template and tool calls use the Hermes format (`<tool_call>` ... `</tool_call>`, special
tokens here).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import jsonschema
import openai
import pydantic
import pytest
from safetensors.torch import save_file

from engine.demo import SIZES, make_demo_model, random_weights
from node_agent.config import AgentConfig
from node_agent.daemon import Agent
from tests.engine.chat_checkpoints import CONTROL_TOKEN, template_text, train_tokenizer

MODEL = "qwen-noise"
DEMO = "demo"
PEER_TOKEN = "peer-secret"
SEEDS = range(20)

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user"],
               "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["id", "name"],
                                       "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                      "name": {"type": "string", "maxLength": 6}}}}},
    "bounded_array": {"type": "object", "additionalProperties": False, "required": ["tags"],
                      "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                              "items": {"type": "string", "maxLength": 4}}}},
    "enums": {"type": "object", "additionalProperties": False, "required": ["color", "size"],
              "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}}},
    "numbers": {"type": "object", "additionalProperties": False, "required": ["ratio", "count"],
                # a noise model writes digits forever where a number may have any; multipleOf bounds them
                "properties": {"ratio": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25},
                               "count": {"type": "integer", "minimum": 0, "maximum": 50}}},
    "optional": {"type": "object", "additionalProperties": False, "required": ["ok"],
                 "properties": {"ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 5},
                                "level": {"type": "integer", "minimum": 0, "maximum": 9}}},
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                                  "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                 "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]


class Forecast(pydantic.BaseModel):
    """What the SDK's `parse` helper turns into a strict json_schema response_format."""
    city: str = pydantic.Field(max_length=8)
    rain: bool
    wind: int = pydantic.Field(ge=0, le=99)


def _build(directory):
    make_demo_model(directory, size="tiny")
    template = template_text("Qwen-Qwen2.5-7B-Instruct")
    tokenizer = train_tokenizer(sorted(set(CONTROL_TOKEN.findall(template))), vocab_size=512)
    tokenizer.save(str(directory / "tokenizer.json"))
    shape, vocab_size = SIZES["tiny"], tokenizer.get_vocab_size(with_added_tokens=True)
    save_file(random_weights(shape, vocab_size, shape.hidden_size // shape.num_heads, seed=5),
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    eos = tokenizer.token_to_id("<|im_end|>")
    config = json.loads((directory / "config.json").read_text())
    config.update(vocab_size=vocab_size, bos_token_id=None, eos_token_id=eos)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": template}))
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("qwen-noise"))


@contextlib.asynccontextmanager
async def serving(cluster, make_router, directory, model: str, **agent_settings):
    """(openai client, the agent's engine) for a router in front of one real agent serving `directory`
    (`agent_settings`: more AgentConfig fields)."""
    agent = Agent(AgentConfig(site="oslo", models={model: str(directory)}, grpc_listen="127.0.0.1:0",
                              metrics_listen=None, peer_token=PEER_TOKEN, kv_cache_bytes=16 << 20, device="cpu",
                              dtype="float32", **{"max_num_seqs": 128, "max_waiting": 256, **agent_settings}))
    await agent.start()
    try:
        await cluster.admin.create_site("oslo", region="eu", country="NO", lat=59.9, lon=10.7,
                                        grpc_address=agent.address, models=[{"model": model, "role": "both"}],
                                        heartbeat_interval_s=60)
        await cluster.heartbeat("oslo")
        key = await cluster.create_key()
        _router, url = await make_router(peer_token=PEER_TOKEN, first_token_timeout_s=60, token_idle_timeout_s=60)
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120) as client:
            yield client, agent.models[model].engine.engine
    finally:
        await agent.stop()


@pytest.fixture
async def served(cluster, make_router, model_dir):
    """The Qwen2.5-templated checkpoint (tools reach the model; Hermes tool calls)."""
    async with serving(cluster, make_router, model_dir, MODEL) as served:
        yield served


@pytest.fixture
async def served_demo(cluster, make_router, tiny_model_dir):
    """The demo model itself (`edgefire make-demo-model --size tiny`)."""
    async with serving(cluster, make_router, tiny_model_dir, DEMO) as served:
        yield served


async def test_every_seed_and_schema_validates_and_json_object_parses(served_demo):
    client, _engine = served_demo

    async def structured(name: str, schema: dict, seed: int):
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": seed % 2 == 0}}
        completion = await client.chat.completions.create(model=DEMO, messages=QUESTION, seed=seed, temperature=1.0,
                                                          max_tokens=160, response_format=fmt)
        return name, completion.choices[0]

    async def json_object(seed: int):
        completion = await client.chat.completions.create(model=DEMO, messages=QUESTION, seed=seed, max_tokens=256,
                                                          response_format={"type": "json_object"})
        return "json_object", completion.choices[0]

    async def sdk_parse(seed: int):
        completion = await client.chat.completions.parse(model=DEMO, messages=QUESTION, seed=seed, max_tokens=60,
                                                         response_format=Forecast)
        return "sdk_parse", completion.choices[0]

    jobs = [structured(name, schema, seed) for name, schema in SCHEMAS.items() for seed in SEEDS]
    jobs += [sdk_parse(seed) for seed in range(4)]
    jobs += [json_object(seed) for seed in range(8)]
    num_closed = 0
    for name, choice in await asyncio.gather(*jobs):
        if name == "sdk_parse":
            assert isinstance(choice.message.parsed, Forecast), choice.message.content
            continue
        if name == "json_object":
            # any JSON object may be long: one cut by max_tokens is "length" (as OpenAI's), every other parses
            num_closed += choice.finish_reason == "stop"
            if choice.finish_reason == "stop":
                assert isinstance(json.loads(choice.message.content), dict)
            else:
                assert choice.finish_reason == "length"
                with pytest.raises(json.JSONDecodeError):
                    json.loads(choice.message.content)
            continue
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    assert num_closed >= 4  # most noise objects close within 256 tokens


async def test_required_and_named_tool_calls_validate_and_stream_the_same(served):
    client, _engine = served
    kinds = [("required", seed) for seed in range(6)] + [("named", seed) for seed in range(6)]

    async def call(kind: str, seed: int, stream: bool):
        choice = "required" if kind == "required" else {"type": "function", "function": {"name": "add"}}
        args = dict(model=MODEL, messages=QUESTION, tools=[WEATHER, ADD], tool_choice=choice, seed=seed,
                    max_tokens=80, parallel_tool_calls=False)
        if not stream:
            return (await client.chat.completions.create(**args)).choices[0]
        calls, finish = {}, None
        async for chunk in await client.chat.completions.create(**args, stream=True):
            for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return calls, finish

    plain = await asyncio.gather(*(call(kind, seed, False) for kind, seed in kinds))
    streamed = await asyncio.gather(*(call(kind, seed, True) for kind, seed in kinds))
    for (kind, seed), choice, (calls, finish) in zip(kinds, plain, streamed):
        assert choice.finish_reason == "tool_calls" == finish, (kind, seed, choice.message.content)
        tool_calls = choice.message.tool_calls
        assert len(tool_calls) == 1  # parallel_tool_calls false (a noise model never stops adding calls)
        for tool_call in tool_calls:
            assert tool_call.type == "function" and tool_call.id.startswith("call_")
            assert kind == "required" or tool_call.function.name == "add"
            jsonschema.validate(json.loads(tool_call.function.arguments), SCHEMA_OF[tool_call.function.name])
        # the stream reassembles to the same calls (ids are per response)
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
            (t.function.name, t.function.arguments) for t in tool_calls]
        assert all(c["id"].startswith("call_") for c in calls.values())
    # a tool result goes back through the template and the conversation continues
    turn = plain[0].message
    follow_up = QUESTION + [turn.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": t.id, "content": "12 degrees"} for t in turn.tool_calls]
    answer = await client.chat.completions.create(model=MODEL, messages=follow_up, tools=[WEATHER, ADD],
                                                  tool_choice="none", max_tokens=4, seed=1)
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.tool_calls is None


async def test_n_choices_share_the_cached_prompt_and_penalties_apply(served):
    client, engine = served
    prompt = [{"role": "user", "content": "Tell me about the weather in Lisbon and in Oslo, in detail please."}]
    before = engine.num_prefix_hit_tokens
    completion = await client.chat.completions.create(model=MODEL, messages=prompt, n=3, seed=4, max_tokens=6)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert len({c.message.content for c in completion.choices}) == 3  # seed + index: different draws
    num_prompt = completion.usage.prompt_tokens
    assert completion.usage.completion_tokens == 18
    # the last two choices read every full KV block of the prompt from the cache (a block with the last
    # token is computed: its logits are needed)
    block = engine.config.block_size
    assert engine.num_prefix_hit_tokens - before == 2 * ((num_prompt - 1) // block * block)
    # n with streaming: every index finishes, one usage at the end
    finishes, usage = {}, None
    async for chunk in await client.chat.completions.create(model=MODEL, messages=prompt, n=3, seed=4, max_tokens=6,
                                                            stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
        usage = chunk.usage or usage
    assert finishes == {0: "length", 1: "length", 2: "length"} and usage.completion_tokens == 18
    # logit_bias reaches the sampler: +100 makes a token the greedy pick (tests/engine checks the values)
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(engine.model_dir / "tokenizer.json"))
    weather = tokenizer.encode(" weather", add_special_tokens=False).ids[0]
    forced = await client.chat.completions.create(model=MODEL, messages=prompt, temperature=0, max_tokens=2,
                                                  logit_bias={str(weather): 100})
    assert forced.choices[0].message.content.startswith(tokenizer.decode([weather]))
    penalized = await client.chat.completions.create(model=MODEL, messages=prompt, temperature=0, max_tokens=12,
                                                     presence_penalty=2.0, frequency_penalty=2.0)
    assert penalized.choices[0].finish_reason in ("stop", "length")

