"""Layouts the machine cannot hold are refused before any rank starts, naming the sizes to lower: on
GPUs, more ranks than GPUs (not a worker's "invalid device ordinal" after it started); on CPU, more
rank processes and KV pools than free memory (not the OOM killer half-way through the start)."""

from __future__ import annotations

import json
import socket

import pytest
import torch

import engine.memory
import engine.parallel.executor as executor_module
from engine.config import load_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import InsufficientMemoryError
from engine.parallel.processes import MAX_MESSAGE, send_message


class RankStarted(Exception):
    pass


@pytest.fixture
def no_rank_starts(monkeypatch):
    def start(specs):
        raise RankStarted(f"ranks {[spec.rank for spec in specs]} were started on {[spec.device for spec in specs]}")

    monkeypatch.setattr(executor_module, "RankProcesses", start)


def _executor(model_dir, device: str, **sizes):
    config = EngineConfig(device=device, **sizes)
    return executor_module.ParallelExecutor(model_dir, load_config(model_dir), config, torch.device(device),
                                            torch.float32)


@pytest.mark.parametrize("device, sizes, message", [
    ("cuda", dict(tensor_parallel_size=2), "tp=2 pp=1 runs 2 ranks, one GPU each from cuda:0 on, but this process "
                                           "sees 1 GPU"),
    ("cuda:1", dict(pipeline_parallel_size=2), "runs 2 ranks, one GPU each from cuda:1 on"),
])
def test_a_layout_wider_than_the_gpus_is_refused_before_any_rank_starts(tiny_model_dir, monkeypatch, no_rank_starts,
                                                                        device, sizes, message):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 if device == "cuda" else 2)
    with pytest.raises(ValueError, match=message) as refused:
        _executor(tiny_model_dir, device, **sizes)
    assert "tensor_parallel_size, pipeline_parallel_size or expert_parallel_size" in str(refused.value)


def test_a_layout_the_gpus_hold_goes_on_to_start_its_ranks(tiny_model_dir, monkeypatch, no_rank_starts):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(RankStarted, match=r"on \['cuda:1', 'cuda:2', 'cuda:3'\]"):
        _executor(tiny_model_dir, "cuda", tensor_parallel_size=2, pipeline_parallel_size=2)


@pytest.mark.parametrize("sizes, message", [
    (dict(tensor_parallel_size=4, pipeline_parallel_size=2, kv_cache_bytes=1 << 20),
     r"tp=4 pp=2: .* across its 8 ranks, a pool each, and 7 worker processes of 160 MiB"),
    # no kv_cache_bytes: each CPU rank still allocates its default pool, which counts
    (dict(tensor_parallel_size=2, pipeline_parallel_size=2),
     r"\+ a 0.25 GiB KV pool \(tp=2 pp=2: .* across its 4 ranks"),
])
def test_cpu_ranks_that_overflow_memory_are_refused_before_any_rank_starts(tiny_model_dir, monkeypatch, no_rank_starts,
                                                                          sizes, message):
    monkeypatch.setattr(engine.memory, "available_bytes", lambda device: 1 << 30)
    with pytest.raises(InsufficientMemoryError, match=message) as refused:
        LLMEngine(tiny_model_dir, EngineConfig(device="cpu", show_progress=False, **sizes))
    assert "fewer ranks (tensor_parallel_size, pipeline_parallel_size, expert_parallel_size)" in str(refused.value)


def test_cpu_ranks_that_fit_go_on_to_start(tiny_model_dir, monkeypatch, no_rank_starts):
    monkeypatch.setattr(engine.memory, "available_bytes", lambda device: 1 << 30)
    with pytest.raises(RankStarted):
        LLMEngine(tiny_model_dir, EngineConfig(device="cpu", show_progress=False, tensor_parallel_size=2,
                                               pipeline_parallel_size=2, kv_cache_bytes=16 << 20))


def test_a_worker_error_longer_than_a_packet_arrives_whole_and_readable():
    """A worker's error over 64 KiB (a long traceback text) was cut as encoded bytes, so the watchdog read JSON
    it could not parse and its thread died: the rank's failure went unreported. Now the text is shortened."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        text = "RuntimeError: " + "é\"x" * 40_000  # escapes make the encoding longer than the text
        send_message(theirs, "error", error=text)
        data, _, _, _ = socket.recv_fds(ours, MAX_MESSAGE, 4)
        message = json.loads(data)
        assert message["kind"] == "error" and message["error"].startswith("RuntimeError: é\"x")
        assert message["error"].endswith("[... cut]") and len(data) <= MAX_MESSAGE
        send_message(theirs, "ready")
        assert json.loads(socket.recv_fds(ours, MAX_MESSAGE, 4)[0]) == {"kind": "ready"}
