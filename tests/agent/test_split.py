"""Disaggregated serving: Prefill on one agent, Decode on another, same tokens as colocated."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from node_agent.proto import agent_pb2
from tests.agent.conftest import MODEL, collect, prompt, sampling, wait_for_free_blocks


@pytest.mark.parametrize("params", [sampling(), sampling(temperature=0.9, top_k=50, top_p=0.95, seed=1234)],
                         ids=["greedy", "seeded"])
async def test_decode_with_pulled_kv_matches_generate(start_agent, connect, params):
    a, b = await start_agent("site-a"), await start_agent("site-b")
    client_a, client_b = connect(a), connect(b)
    free_a, free_b = (await client_a.health()).kv_blocks_free, (await client_b.health()).kv_blocks_free
    prompt_ids = prompt(40)

    colocated = await collect(client_a.generate(agent_pb2.GenerateRequest(
        request_id="ref", model=MODEL, prompt_ids=prompt_ids, sampling=params)))

    result = await client_a.prefill(agent_pb2.PrefillRequest(request_id="r1", model=MODEL, prompt_ids=prompt_ids,
                                                             sampling=params))
    assert result.kv_handle and result.finish_reason == "" and result.kv_bytes > 0
    decoded = await collect(client_b.decode(agent_pb2.DecodeRequest(
        request_id="r1", model=MODEL, prompt_ids=prompt_ids, generated_ids=[result.first_token.token_id],
        sampling=params, kv_source=agent_pb2.KVSource(address=a.address, kv_handle=result.kv_handle))))

    assert [result.first_token.token_id, *decoded] == colocated
    assert a.metrics.kv_bytes_sent._value.get() == result.kv_bytes
    assert b.metrics.kv_bytes_received._value.get() == result.kv_bytes
    assert b.metrics.kv_fallbacks._value.get() == 0
    assert await wait_for_free_blocks(client_a, free_a) == free_a
    assert await wait_for_free_blocks(client_b, free_b) == free_b


async def test_decode_without_source_resumes_like_generate(start_agent, connect):
    a = await start_agent()
    client = connect(a)
    params = sampling(temperature=0.7, seed=99)
    prompt_ids = prompt(30, start=3)
    reference = await collect(client.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt_ids,
                                                                         sampling=params)))
    resumed = await collect(client.decode(agent_pb2.DecodeRequest(model=MODEL, prompt_ids=prompt_ids,
                                                                  generated_ids=reference[:5], sampling=params)))
    assert reference[:5] + resumed == reference


async def test_decode_beyond_max_num_seqs_is_refused_with_resource_exhausted(start_agent, connect):
    """A full decode site says RESOURCE_EXHAUSTED (the router then moves on); it never runs more than its limit."""
    a, b = await start_agent("site-a"), await start_agent("site-b", max_num_seqs=2)
    client_a, client_b = connect(a), connect(b)
    free_b = (await client_b.health()).kv_blocks_free
    params = sampling(max_tokens=24)
    leases = []
    for i in range(5):
        prompt_ids = prompt(20, start=i)
        result = await client_a.prefill(agent_pb2.PrefillRequest(request_id=f"r{i}", model=MODEL,
                                                                 prompt_ids=prompt_ids, sampling=params))
        leases.append((prompt_ids, result))
    most_running = 0
    decoding = True

    async def watch() -> None:
        nonlocal most_running
        while decoding:
            most_running = max(most_running, (await client_b.health()).num_running)
            await asyncio.sleep(0.005)

    async def decode(prompt_ids, result) -> str:
        call = client_b.decode(agent_pb2.DecodeRequest(
            model=MODEL, prompt_ids=prompt_ids, generated_ids=[result.first_token.token_id], sampling=params,
            kv_source=agent_pb2.KVSource(address=a.address, kv_handle=result.kv_handle)))
        try:
            tokens = await collect(call)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            assert "max_num_seqs" in exc.details()
            await client_a.release_kv(result.kv_handle)
            return "refused"
        assert len(tokens) == 23
        return "served"

    watcher = asyncio.create_task(watch())
    outcomes = await asyncio.gather(*(decode(p, r) for p, r in leases))
    decoding = False
    await watcher
    assert outcomes.count("served") >= 2 and outcomes.count("refused") >= 1
    assert most_running <= 2
    assert await wait_for_free_blocks(client_b, free_b) == free_b


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    from engine.demo import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("tiny-deepseek"), size="tiny", arch="deepseek-v3")


async def test_latent_kv_moves_between_agents_and_gives_the_colocated_tokens(deepseek_dir, connect):
    """DeepSeek-V3's KV is one latent per token and layer: what GetModelInfo reports per token, what
    a Prefill leases, and what the decode agent pulls over the data port and continues from."""
    import json

    from node_agent.daemon import Agent
    from tests.agent.conftest import agent_config

    agents = [Agent(agent_config(deepseek_dir, site)) for site in ("site-a", "site-b")]
    for agent in agents:
        await agent.start()
    try:
        a, b = agents
        client_a, client_b = connect(a), connect(b)
        raw = json.loads((deepseek_dir / "config.json").read_text())
        per_token = raw["num_hidden_layers"] * (raw["kv_lora_rank"] + raw["qk_rope_head_dim"]) * 4
        assert (await client_a.model_info(MODEL)).kv_bytes_per_token == per_token
        params, prompt_ids = sampling(), prompt(40)
        colocated = await collect(client_a.generate(agent_pb2.GenerateRequest(
            request_id="ref", model=MODEL, prompt_ids=prompt_ids, sampling=params)))
        result = await client_a.prefill(agent_pb2.PrefillRequest(request_id="r1", model=MODEL,
                                                                 prompt_ids=prompt_ids, sampling=params))
        assert result.kv_bytes == len(prompt_ids) * per_token
        decoded = await collect(client_b.decode(agent_pb2.DecodeRequest(
            request_id="r1", model=MODEL, prompt_ids=prompt_ids, generated_ids=[result.first_token.token_id],
            sampling=params, kv_source=agent_pb2.KVSource(address=a.address, kv_handle=result.kv_handle))))
        assert [result.first_token.token_id, *decoded] == colocated
        assert b.metrics.kv_bytes_received._value.get() == result.kv_bytes
        assert b.metrics.kv_fallbacks._value.get() == 0
    finally:
        for agent in agents:
            await agent.stop()


@pytest.fixture(scope="module")
def fine_tuned_dir(tiny_model_dir, tmp_path_factory):
    """The tiny checkpoint with one tensor nudged, as a fine-tune leaves it: same name, config, files and sizes."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    directory = tmp_path_factory.mktemp("tiny-fine-tuned")
    shutil.copytree(tiny_model_dir, directory, dirs_exist_ok=True)
    weights = load_file(directory / "model.safetensors")
    name = "model.layers.1.self_attn.v_proj.weight"
    weights[name] = weights[name] + 0.5 * torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(3))
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


async def test_decode_refuses_kv_of_another_checkpoint_of_the_same_name(start_agent, connect, fine_tuned_dir):
    """KV prefilled by one checkpoint must not be decoded by another that merely has the same shape: the
    decode site refuses it and recomputes the prompt with its own weights."""
    a, b = await start_agent("site-a"), await start_agent("site-b", models={MODEL: str(fine_tuned_dir)})
    client_a, client_b = connect(a), connect(b)
    free_b = (await client_b.health()).kv_blocks_free
    params, prompt_ids = sampling(), prompt(40)
    result = await client_a.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids, sampling=params))
    first = result.first_token.token_id
    request = dict(model=MODEL, prompt_ids=prompt_ids, generated_ids=[first], sampling=params)
    own = await collect(client_b.decode(agent_pb2.DecodeRequest(**request)))  # b's weights from the first token on
    foreign = await collect(client_a.decode(agent_pb2.DecodeRequest(**request)))
    assert own != foreign  # the checkpoints really answer differently

    decoded = await collect(client_b.decode(agent_pb2.DecodeRequest(
        **request, kv_source=agent_pb2.KVSource(address=a.address, kv_handle=result.kv_handle))))

    assert decoded == own
    assert b.metrics.kv_fallbacks._value.get() == 1 and b.metrics.kv_bytes_received._value.get() == 0
    assert await wait_for_free_blocks(client_b, free_b) == free_b
    assert await a.core.num_leases() == 0  # the refused pull still ended the lease
