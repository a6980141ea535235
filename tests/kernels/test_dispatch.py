"""Kernel selection: CPU engines keep the torch ops and never import triton (it is optional)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from engine import ops

CPU_RUN = """
import sys
from engine import ops
from engine.engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
engine = LLMEngine(sys.argv[1], EngineConfig(device="cpu", kv_cache_bytes=1 << 20, show_progress=False))
engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
while engine.has_work():
    engine.step()
assert engine.model.ops is ops, engine.model.ops
assert "triton" not in sys.modules, "a CPU engine imported triton"
"""


def test_cpu_device_uses_torch_ops():
    assert ops.for_device(torch.device("cpu")) is ops
    assert ops.for_device("cpu") is ops


def test_cpu_engine_never_imports_triton(tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", CPU_RUN, str(tiny_model_dir)], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
