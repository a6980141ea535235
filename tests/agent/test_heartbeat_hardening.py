"""What a site's heartbeat says about it, as its operator reads it (`edgefire status`, the dashboard):
GPUs that several models share counted once, a layout some engine really runs, heartbeats a registry
older than the agent still takes, and an agent that stops (for its supervisor) when an engine died."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pydantic import ValidationError, create_model

from engine.engine import EngineStats
from engine.parallel.executor import rank_devices
from node_agent import daemon
from node_agent.daemon import Agent
from node_agent.errors import ModelLoadError
from node_agent.heartbeat import HeartbeatLoop, Registration, capacity_report
from registry.client import RegistryError
from registry.http_errors import validation_problem
from registry.wire import CapacityReport, WireModel
from tests.agent.conftest import MODEL, agent_config


def stats(tp: int = 1, pp: int = 1, ep: int = 1) -> EngineStats:
    return EngineStats(num_blocks_total=100, num_blocks_free=40, block_size=16, num_running=1, num_waiting=0,
                       num_pinned_handles=0, inflight_prefill_tokens=0, inflight_decode_tokens=0,
                       prefill_tokens_per_s=0.0, decode_tokens_per_s=0.0, decode_batch_size=0.0,
                       decode_kv_tokens=0.0, num_preemptions=0, prefix_cache_hit_tokens=0,
                       num_gpus=max(tp, ep) * pp, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                       expert_parallel_size=ep)


def report(engines: list[tuple[str, EngineStats]]) -> dict:
    """The heartbeat of a site whose models all start at `device` (the agent's one device setting), each
    engine's ranks where a parallel engine places them."""
    for device, engine in engines:
        world_size = max(engine.tensor_parallel_size, engine.expert_parallel_size) * engine.pipeline_parallel_size
        engine.gpu_indices = tuple(d.index for d in rank_devices(torch.device(device), world_size) if d.type == "cuda")
    return capacity_report(16, False, [engine for _, engine in engines], []).to_json()


def test_models_sharing_gpus_count_each_gpu_once():
    # two models at tp=2 on the same two GPUs: 2 GPUs (it said 4)
    assert report([("cuda", stats(tp=2)), ("cuda", stats(tp=2))])["num_gpus"] == 2
    # a dense model on one rank beside a mixture of experts on ep=2: 2 GPUs (it said 3)
    assert report([("cuda:0", stats()), ("cuda:0", stats(ep=2))])["num_gpus"] == 2
    # an engine from another device index adds its own GPUs
    assert report([("cuda:0", stats(tp=2)), ("cuda:2", stats(tp=2))])["num_gpus"] == 4
    assert report([("cpu", stats(tp=2)), ("cpu", stats(ep=2))])["num_gpus"] == 0


def test_the_layout_reported_is_one_an_engine_runs():
    # dense on pp=2 beside a MoE on tp=2 ep=2: both run 2 ranks; the largest of each size taken apart
    # said tp=2 pp=2 ep=2, 4 ranks that no engine has
    wire = report([("cpu", stats(pp=2)), ("cpu", stats(tp=2, ep=2))])
    assert (wire["tensor_parallel_size"], wire["pipeline_parallel_size"], wire["expert_parallel_size"]) == (1, 2, 1)
    wire = report([("cpu", stats()), ("cpu", stats(ep=2))])
    assert (wire["tensor_parallel_size"], wire["pipeline_parallel_size"], wire["expert_parallel_size"]) == (1, 1, 2)
    assert (wire["kv_blocks_total"], wire["kv_blocks_free"]) == (200, 80)  # a KV pool per model: summed


async def test_an_agent_with_two_models_on_one_gpu_reports_one(tiny_model_dir):
    agent = Agent(agent_config(tiny_model_dir, "two-models", models={"a": str(tiny_model_dir),
                                                                     "b": str(tiny_model_dir)}))
    await agent.start()
    try:
        assert (await agent.capacity()).num_gpus == 0  # CPU ranks
        # both engines as they stand on a GPU machine with device "cuda" (this one has none): each on cuda:0
        for model in agent.models.values():
            model.engine.engine.device = torch.device("cuda")
        assert (await agent.capacity()).num_gpus == 1  # it said 2
    finally:
        for model in agent.models.values():
            model.engine.engine.device = torch.device("cpu")
        await agent.stop()


class OlderRegistry:
    """A registry client whose registry predates some heartbeat fields: it validates heartbeats as the
    registry does (unknown fields refused, with the registry's own 422 message)."""

    def __init__(self, known: set[str]):
        fields = {name: (info.annotation, info) for name, info in CapacityReport.model_fields.items() if name in known}
        self.contract = create_model("OlderCapacityReport", __base__=WireModel, **fields)
        self.stored: list[dict] = []
        self.beat = asyncio.Event()

    async def register_site(self, *args) -> None:
        return None

    async def heartbeat(self, body: dict) -> dict:
        try:
            self.contract.model_validate(body)
        except ValidationError as exc:
            status, message, code = validation_problem(exc.errors(include_url=False))
            raise RegistryError(status, message, code) from None
        self.stored.append(body)
        self.beat.set()
        return {"state": "active"}

    async def deregister(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


async def test_a_registry_older_than_the_agent_still_takes_its_heartbeats(caplog):
    newer = {"num_gpus", "expert_parallel_size", "speculative_acceptance"}
    registry = OlderRegistry(set(CapacityReport.model_fields) - newer)

    async def capacity() -> CapacityReport:
        return capacity_report(16, False, [stats(ep=2)], [])

    loop = HeartbeatLoop(registry, Registration("old-registry", "127.0.0.1:1", [], 30.0), capacity)
    loop.start()
    try:
        await asyncio.wait_for(registry.beat.wait(), 10)  # it was refused every time, the site never alive
    finally:
        await loop.stop(deregister=True)
    assert loop.num_failures == 0
    assert registry.stored[0]["kv_blocks_total"] == 100 and newer.isdisjoint(registry.stored[0])
    assert loop.left_out == newer
    assert "does not know the heartbeat field speculative_acceptance" in caplog.text


async def test_other_refusals_are_not_taken_for_an_older_registry():
    registry = OlderRegistry(set(CapacityReport.model_fields))

    async def capacity() -> CapacityReport:
        return capacity_report(16, False, [stats()], [])

    async def refuse(body: dict) -> dict:
        raise RegistryError(422, "kv_blocks_total: is not a field of this request (check its spelling)",
                            "invalid_field")

    registry.heartbeat = refuse  # a required field cannot be left out: the refusal stands
    loop = HeartbeatLoop(registry, Registration("strict", "127.0.0.1:1", [], 30.0), capacity)
    with pytest.raises(RegistryError):
        await loop._beat()
    assert loop.left_out == set()


async def test_an_agent_whose_engine_died_with_its_figures_asked_for_still_stops(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(daemon, "FAILED_LINGER_S", 0.1)
    registry = OlderRegistry(set(CapacityReport.model_fields))
    agent = Agent(agent_config(tiny_model_dir, "dies", heartbeat_interval_s=0.05))
    await agent.start()
    agent.heartbeats = HeartbeatLoop(registry, Registration("dies", agent.address, [], 0.05), agent.capacity)
    agent.heartbeats.start()
    await asyncio.wait_for(registry.beat.wait(), 10)

    def gpu_lost():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    # The engine thread dies running the heartbeat's own request: that request is never answered.
    agent.models[MODEL].engine.engine.stats = gpu_lost
    try:
        await asyncio.wait_for(agent.wait_stopped(), 10)  # it hung in stop(), waiting on that heartbeat
    finally:
        if not agent._stopped.is_set():
            agent.heartbeats._task.cancel()
            agent.heartbeats = None
            await agent.stop()
    assert agent.exit_code == 1


async def test_a_model_that_fails_to_load_takes_the_loaded_ones_down_with_it(tiny_model_dir, tmp_path, monkeypatch):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_model_dir / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    loaded = []

    async def recording_load(name, path, config):
        model = await load_model(name, path, config)
        loaded.append(model)
        return model

    load_model = daemon.load_model
    monkeypatch.setattr(daemon, "load_model", recording_load)
    agent = Agent(agent_config(tiny_model_dir, "half", models={MODEL: str(tiny_model_dir), "broken": str(broken)}))
    with pytest.raises(ModelLoadError, match="model broken"):
        await agent.start()
    await agent.stop()
    for _ in range(200):  # the good model's load may still run when the broken one's error arrives
        if loaded:
            break
        await asyncio.sleep(0.05)
    assert [model.name for model in loaded] == [MODEL]
    assert not loaded[0].engine.alive  # its step thread (and any rank processes) kept running
