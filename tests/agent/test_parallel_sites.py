"""Sites whose engines span several ranks: KV moves between sites of different layouts, the
heartbeat carries the layout, and a dead rank takes its site out of service (Health NOT_SERVING,
then `edgefire agent` exits non-zero for its supervisor to restart it).

One test, so the multi-rank agents start once (each rank imports torch). Run with `-m parallel`.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

import node_agent.daemon
from node_agent.cli import _serve
from node_agent.proto import agent_pb2
from tests.agent.conftest import MODEL, agent_config, collect, prompt, sampling
from tests.engine.test_parallel import _gone

pytestmark = pytest.mark.parallel


async def _serve_in_this_process(config, monkeypatch) -> tuple[asyncio.Task, node_agent.daemon.Agent]:
    """`edgefire agent`'s own serve loop, run here, with a handle on the agent it starts."""
    started: list[node_agent.daemon.Agent] = []

    class Captured(node_agent.daemon.Agent):
        def __init__(self, config):
            super().__init__(config)
            started.append(self)

    monkeypatch.setattr(node_agent.daemon, "Agent", Captured)
    task = asyncio.create_task(_serve(config))
    while not (started and started[0].address and started[0].core):
        assert not task.done(), task
        await asyncio.sleep(0.05)
    return task, started[0]


async def test_split_across_layouts_and_a_dead_rank_takes_the_site_down(start_agent, connect, tiny_model_dir,
                                                                      monkeypatch):
    single = await start_agent("single")
    pipeline = await start_agent("pp2", pipeline_parallel_size=2)
    serving, tensor = await _serve_in_this_process(agent_config(tiny_model_dir, "tp2", tensor_parallel_size=2),
                                                   monkeypatch)
    try:
        client_single, client_tp, client_pp = connect(single), connect(tensor), connect(pipeline)

        # routers size KV per model: every layout reports the same bytes per token (the canonical layout)
        infos = [await client.model_info(MODEL) for client in (client_single, client_tp, client_pp)]
        assert len({info.kv_bytes_per_token for info in infos}) == 1

        # tp=2 prefills, pp=2 pulls the KV over the data port and decodes: the tokens of tp=1 colocated
        params, prompt_ids = sampling(max_tokens=8), prompt(40)
        colocated = await collect(client_single.generate(agent_pb2.GenerateRequest(
            model=MODEL, prompt_ids=prompt_ids, sampling=params)))
        result = await client_tp.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids, sampling=params))
        decoded = await collect(client_pp.decode(agent_pb2.DecodeRequest(
            model=MODEL, prompt_ids=prompt_ids, generated_ids=[result.first_token.token_id], sampling=params,
            kv_source=agent_pb2.KVSource(address=tensor.address, kv_handle=result.kv_handle))))
        assert [result.first_token.token_id, *decoded] == colocated
        assert pipeline.metrics.kv_fallbacks._value.get() == 0

        # the heartbeat names the layout (CPU: no GPUs)
        report = await tensor.capacity()
        assert (report.tensor_parallel_size, report.pipeline_parallel_size, report.num_gpus) == (2, 1, 0)
        assert ((await pipeline.capacity()).pipeline_parallel_size, (await single.capacity()).num_gpus) == (2, 0)

        # rank 1 dies mid-stream: the stream fails, the site says NOT_SERVING, the agent exits with 1
        assert (await client_tp.health()).status == agent_pb2.HealthResponse.SERVING
        worker = tensor.models[MODEL].engine.engine.executor.processes.procs[1].pid
        stream = client_tp.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(30, start=5),
                                                              sampling=sampling(max_tokens=400)))
        chunks = aiter(stream)
        await anext(chunks)
        os.kill(worker, signal.SIGKILL)
        killed_at = asyncio.get_running_loop().time()
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in chunks:
                pass
        while (await client_tp.health()).status != agent_pb2.HealthResponse.NOT_SERVING:
            assert asyncio.get_running_loop().time() - killed_at < 10
            await asyncio.sleep(0.05)
        assert await asyncio.wait_for(serving, timeout=30) == 1
        assert _gone(worker)
    finally:
        if not serving.done():
            await tensor.stop()
            await serving
