"""Bad requests get the right gRPC status and a message that says what to change."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import grpc
import pytest
from grpc import aio

from engine.tokenizer import ChatTokenizer
from node_agent.proto import agent_pb2
from router.model_assets import build_assets
from tests.agent.conftest import MODEL, collect, prompt, sampling, wait_for_free_blocks


async def status_of(make_call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(aio.AioRpcError) as info:
        result = make_call()
        if hasattr(result, "__aiter__"):
            await collect(result)
        else:
            await result
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("request_fields, code, words", [
    (dict(model="nope", prompt_ids=[1, 2]), grpc.StatusCode.NOT_FOUND, "model 'nope' is not served"),
    (dict(model=MODEL, prompt_ids=[]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids is empty"),
    (dict(model=MODEL, prompt_ids=[1, 99999]), grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
    (dict(model=MODEL, prompt_ids=[1], sampling=sampling(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT,
     "temperature must be in [0, 100]"),
    (dict(model=MODEL, prompt_ids=[1], sampling=sampling(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT,
     "top_p must be in (0, 1]"),
    (dict(model=MODEL, prompt_ids=[1], sampling=sampling(max_tokens=0)), grpc.StatusCode.INVALID_ARGUMENT,
     "max_tokens must be"),
    (dict(model=MODEL, prompt_ids=[1], sampling=sampling(logprobs=500)), grpc.StatusCode.INVALID_ARGUMENT,
     "logprobs must be in"),
    (dict(model=MODEL, prompt_ids=[1] * 5000), grpc.StatusCode.INVALID_ARGUMENT, "the context holds"),
])
async def test_bad_requests_get_clear_status(start_agent, connect, request_fields, code, words):
    agent = await start_agent()
    client = connect(agent)
    request_fields.setdefault("sampling", sampling())
    for rpc, kind in ((client.generate, agent_pb2.GenerateRequest), (client.prefill, agent_pb2.PrefillRequest),
                      (client.decode, agent_pb2.DecodeRequest)):
        got_code, message = await status_of(lambda: rpc(kind(**request_fields)))
        assert got_code == code and words in message, (rpc, got_code, message)


@pytest.mark.parametrize("token, words", [(None, "missing authorization"), ("wrong", "not valid")])
async def test_missing_or_wrong_token_is_unauthenticated(start_agent, connect, token, words):
    agent = await start_agent()
    client = connect(agent, token="wrong")
    if token is None:
        client._token = None
        client.metadata = lambda request_id=None: ()
    calls = [lambda: client.health(), lambda: client.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=[1])),
             lambda: client.fetch_kv("x"), lambda: client.model_info(MODEL)]
    for make_call in calls:
        code, message = await status_of(make_call)
        assert code == grpc.StatusCode.UNAUTHENTICATED and words in message


async def test_unknown_handles(start_agent, connect):
    client = connect(await start_agent())
    code, message = await status_of(lambda: client.fetch_kv(f"{MODEL}/deadbeef"))
    assert code == grpc.StatusCode.NOT_FOUND and "unknown, released or expired" in message
    code, _ = await status_of(lambda: client.fetch_kv("garbage"))
    assert code == grpc.StatusCode.NOT_FOUND
    assert await client.release_kv(f"{MODEL}/deadbeef") is False


async def test_full_queue_is_resource_exhausted(start_agent, connect):
    agent = await start_agent(max_waiting=0)  # a limit of zero waiting requests: the queue is always full
    client = connect(agent)
    code, message = await status_of(lambda: client.generate(agent_pb2.GenerateRequest(
        model=MODEL, prompt_ids=prompt(10), sampling=sampling())))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in message


async def test_a_full_agent_refuses_at_once_while_its_engine_is_busy(start_agent, connect):
    """Admission reads the engine's stats as of its last step: it never waits for a step in progress
    (a long prefill chunk), so a refusal reaches the router while another site can still be tried."""
    agent = await start_agent(max_waiting=0)
    engine = agent.models[MODEL].engine
    release = threading.Event()
    busy = asyncio.ensure_future(engine.call(lambda _engine: release.wait(30)))  # a step that does not end
    try:
        code, message = await asyncio.wait_for(status_of(lambda: connect(agent).generate(agent_pb2.GenerateRequest(
            model=MODEL, prompt_ids=prompt(10), sampling=sampling()))), timeout=10)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in message
        assert not busy.done()
    finally:
        release.set()
        await busy


@pytest.mark.parametrize("limit, overrides, refusal", [
    ("queue", dict(max_waiting=3), "queue is full"),
    # 9 blocks of 16 tokens; each request needs 2, and the engine keeps 1 free (its watermark) beside running ones
    ("kv", dict(kv_cache_bytes=9 * 8192), "KV pool is full"),
])
async def test_a_burst_within_one_step_is_held_to_the_limits(start_agent, connect, limit, overrides, refusal):
    """Requests arriving while a step runs all saw that step's stats: ten at once were all admitted past a
    queue of 3 (a router saw 153 waiting against a limit of 64) or a pool with room for 4. Admission now
    counts what it handed the engine since those stats."""
    agent = await start_agent(**overrides)
    engine = agent.models[MODEL].engine
    client = connect(agent)
    release = threading.Event()
    busy = asyncio.ensure_future(engine.call(lambda _engine: release.wait(30)))  # a step that does not end
    calls = [asyncio.ensure_future(collect(client.generate(agent_pb2.GenerateRequest(
        model=MODEL, prompt_ids=prompt(20, start=i), sampling=sampling(max_tokens=2))))) for i in range(10)]
    try:
        await asyncio.sleep(0.5)  # every admission has been answered or handed to the busy engine
        refused = [call for call in calls if call.done()]
        assert len(refused) == 10 - (3 if limit == "queue" else 4)
        for call in refused:
            assert call.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert refusal in call.exception().details()
    finally:
        release.set()
        await busy
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert sum(isinstance(outcome, list) and len(outcome) == 2 for outcome in outcomes) == 10 - len(refused)


async def test_kv_pool_full_is_resource_exhausted(start_agent, connect):
    agent = await start_agent(kv_cache_bytes=8 * 8192, kv_lease_ttl_s=60)  # 8 blocks of 16 tokens
    client = connect(agent)
    leased = await client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt(100), sampling=sampling()))
    code, message = await status_of(lambda: client.generate(agent_pb2.GenerateRequest(
        model=MODEL, prompt_ids=prompt(60, start=3), sampling=sampling())))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV pool is full" in message
    assert await client.release_kv(leased.kv_handle) is True
    assert len(await collect(client.generate(agent_pb2.GenerateRequest(
        model=MODEL, prompt_ids=prompt(60, start=3), sampling=sampling(max_tokens=4))))) == 4


async def test_a_prefix_running_sequences_hold_takes_no_free_blocks(start_agent, connect):
    # A hot shared prefix (a long system prompt) is in the prefix cache, held by a running request: another request
    # with it needs only the blocks past it, not room for its whole prompt.
    agent = await start_agent(kv_cache_bytes=8 * 8192, kv_lease_ttl_s=60)  # 8 blocks of 16 tokens
    client = connect(agent)
    system = prompt(100)
    leased = await client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=system, sampling=sampling()))
    shared = system[:96] + prompt(4, start=7)   # 7 blocks with its first token, 6 of them the lease's: 1 free left
    chunks = [chunk async for chunk in client.generate(agent_pb2.GenerateRequest(
        model=MODEL, prompt_ids=shared, sampling=sampling(max_tokens=4)))]
    assert sum(len(chunk.tokens) for chunk in chunks) == 4
    assert max(chunk.num_cached_tokens for chunk in chunks) == 96
    # a prompt as long without the prefix still finds the pool full
    code, message = await status_of(lambda: client.generate(agent_pb2.GenerateRequest(
        model=MODEL, prompt_ids=prompt(100, start=3), sampling=sampling())))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV pool is full" in message
    assert await client.release_kv(leased.kv_handle) is True


async def test_a_prefix_a_step_in_progress_just_took_is_not_counted_free_and_shared(start_agent, connect):
    # Admission reads the stats of the last step, and the shared prefix live. A step in progress that just took the
    # cached prefix (evictable, so free in those stats) for a new sequence made it both free and shared: a prompt
    # the pool could not hold was admitted on that double count, and then waited in the engine's queue (here until a
    # KV lease ended) instead of being refused at once for the router to try another site.
    agent = await start_agent(kv_cache_bytes=16 * 8192, kv_lease_ttl_s=60)  # 16 blocks of 16 tokens
    client = connect(agent)
    system = prompt(96)  # 6 blocks
    assert len(await collect(client.generate(agent_pb2.GenerateRequest(
        model=MODEL, prompt_ids=system + prompt(4, start=5), sampling=sampling(max_tokens=1))))) == 1
    assert await wait_for_free_blocks(client, 16) == 16   # the prefix is cached, evictable
    leased = await client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt(90, start=3),
                                                           sampling=sampling()))   # 6 blocks: 10 free
    engine = agent.models[MODEL].engine.engine
    run, entered, release = engine.executor.run, threading.Event(), threading.Event()

    def held_run(inputs):  # the next step's forward holds on: it has taken its blocks, its stats are not out
        entered.set()
        release.wait(30)
        return run(inputs)

    engine.executor.run = held_run
    first = asyncio.ensure_future(collect(client.generate(agent_pb2.GenerateRequest(
        model=MODEL, prompt_ids=system + prompt(4, start=9), sampling=sampling(max_tokens=2)))))
    try:
        assert await asyncio.to_thread(entered.wait, 10)
        # 12 blocks with its first token, 6 of them the running request's: 6 more, and 3 are free (not 10)
        code, message = await asyncio.wait_for(status_of(lambda: client.generate(agent_pb2.GenerateRequest(
            model=MODEL, prompt_ids=system + prompt(80, start=11), sampling=sampling(max_tokens=1)))), timeout=10)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV pool is full" in message
    finally:
        engine.executor.run = run
        release.set()
    assert len(await first) == 2
    assert await client.release_kv(leased.kv_handle) is True


async def test_role_is_enforced(start_agent, connect):
    client = connect(await start_agent(role="decode"))
    code, message = await status_of(lambda: client.prefill(agent_pb2.PrefillRequest(
        model=MODEL, prompt_ids=[1, 2], sampling=sampling())))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "role is decode" in message


async def test_model_info(start_agent, connect, tiny_model_dir):
    client = connect(await start_agent())
    info = await client.model_info(MODEL)
    assert info.tokenizer_json == (tiny_model_dir / "tokenizer.json").read_text()
    assert "<|start_header_id|>" in info.chat_template
    assert info.context_length > 0 and info.vocab_size == 512 and info.block_size == 16
    assert info.eos_token_ids and info.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    code, _ = await status_of(lambda: client.model_info("nope"))
    assert code == grpc.StatusCode.NOT_FOUND
    # The KV figure routers place with follows the engine's KV dtype: bfloat16 holds half of float32.
    bf16 = await connect(await start_agent("site-b", dtype="bfloat16")).model_info(MODEL)
    assert bf16.kv_bytes_per_token == info.kv_bytes_per_token // 2


async def test_model_info_carries_a_chat_template_kept_in_its_own_file(start_agent, connect, tiny_model_dir, tmp_path):
    """Newer checkpoints keep the chat template in chat_template.jinja: routers render what the engine's own
    tokenizer renders, not a prompt without the template."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = config.pop("chat_template").replace("<|start_header_id|>", "<|start_header_id|> ")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").write_text(template)
    info = await connect(await start_agent(models={MODEL: str(model_dir)})).model_info(MODEL)
    assert info.chat_template == template
    messages = [{"role": "user", "content": "hello"}]
    assert (build_assets(info).tokenizer.apply_chat_template(messages)
            == ChatTokenizer.from_dir(model_dir).apply_chat_template(messages))
