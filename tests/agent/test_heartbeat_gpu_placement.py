"""The GPUs a site reports are the ones its engines placed their ranks on: a tensor-parallel engine's
stats carry its executor's devices, and the heartbeat counts each GPU once over the site's models.
The engines run on CPU (gloo); where a GPU placement is needed, the executor's devices are those its
ranks get on a machine with four GPUs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.parallel.executor import rank_devices
from node_agent.heartbeat import ModelFigures, site_capacity_report

pytestmark = pytest.mark.parallel


def config(**sizes) -> EngineConfig:
    return EngineConfig(device="cpu", dtype="float32", kv_cache_bytes=4 << 20, show_progress=False, **sizes)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """A tp=2 engine (two rank processes) and a single-rank one."""
    tensor = LLMEngine(tiny_model_dir, config(tensor_parallel_size=2))
    single = LLMEngine(tiny_model_dir, config())
    yield tensor, single
    tensor.shutdown()
    single.shutdown()


def test_a_parallel_engine_on_cpu_reports_no_gpu(engines):
    tensor, single = engines
    assert tensor.executor.rank_devices == [torch.device("cpu")] * 2
    stats = tensor.stats()
    assert (stats.gpu_indices, stats.num_gpus) == ((), 0)
    report = site_capacity_report(16, False, {"tp2": ModelFigures(stats), "single": ModelFigures(single.stats())})
    assert report.num_gpus == 0


def test_the_heartbeat_counts_the_gpus_the_executor_placed_its_ranks_on(engines, monkeypatch):
    tensor, single = engines
    # the executor as it stands when started from cuda:2: its ranks on cuda:2 and cuda:3
    monkeypatch.setattr(tensor.executor, "rank_devices", rank_devices(torch.device("cuda:2"), 2))
    stats = tensor.stats()
    assert (stats.gpu_indices, stats.num_gpus) == ((2, 3), 2)
    # beside a single-rank model on cuda:0 the site has three GPUs; two models on the same two, two
    monkeypatch.setattr(single, "device", torch.device("cuda"))
    beside = site_capacity_report(16, False, {"tp2": ModelFigures(stats), "single": ModelFigures(single.stats())})
    assert beside.num_gpus == 3
    shared = site_capacity_report(16, False, {"a": ModelFigures(stats), "b": ModelFigures(tensor.stats())})
    assert shared.num_gpus == 2


def test_the_heartbeat_module_reads_the_figures_without_importing_torch():
    probe = "import sys, node_agent.heartbeat; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
