"""`edgefire compress` format 2 at its edges: a scalar kept in its own dtype (a float32 0-dim entry beside bf16
weights, as a checkpoint's scales are stored) is written, read back bit for bit and dtype for dtype, and leaves the
copy the source's exact copy (same weight identity, hence fingerprint); relabelled, it is refused."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.compression.checkpoint import PLAIN_DTYPE_PREFIX, CompressedCheckpoint
from engine.compression.compress import compress_checkpoint
from engine.errors import CheckpointError
from engine.fingerprint import weight_identity
from engine.loader import checkpoint_files


def test_a_float32_scalar_is_kept_as_it_is(tiny_model_dir, tmp_path):
    source, copy = tmp_path / "src", tmp_path / "copy"
    shutil.copytree(tiny_model_dir, source)
    weights = {name: t.to(torch.bfloat16) for name, t in load_file(source / "model.safetensors").items()}
    weights["model.logit_scale"] = torch.tensor(1.2345678, dtype=torch.float32)   # no bf16 value
    vector = next(name for name, t in weights.items() if t.dim() == 1)
    weights[vector] = weights[vector].half()
    save_file(weights, str(source / "model.safetensors"), metadata={"format": "pt"})
    said = []
    compress_checkpoint(source, copy, show_progress=False, say=said.append)
    assert not [line for line in said if "converted" in line]
    assert weight_identity(copy) == weight_identity(source)
    checkpoint = CompressedCheckpoint(copy, checkpoint_files(copy))
    for name, tensor in weights.items():
        read = checkpoint.read(name)
        assert read.dtype == tensor.dtype and torch.equal(read, tensor), name
    shard = copy / "model.safetensors"   # its record made to name another dtype
    with safe_open(str(shard), framework="pt") as handle:
        metadata, entries = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}
    assert metadata[PLAIN_DTYPE_PREFIX + "model.logit_scale"] == "torch.float32"
    save_file(entries, str(shard), metadata={**metadata, PLAIN_DTYPE_PREFIX + "model.logit_scale": "torch.float16"})
    with pytest.raises(CheckpointError, match="'model.logit_scale' is stored as torch.float32"):
        CompressedCheckpoint(copy, checkpoint_files(copy)).read("model.logit_scale")
