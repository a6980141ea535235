"""`edgefire compress` as users run it: mixture-of-experts sources, destinations that overlap the
source, killed runs; and damage the format's own checks must catch: a lost manifest, a changed
byte in a tensor stored plain."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from deploy.cli import main as edgefire
from engine.compression import compress
from engine.compression.checkpoint import MANIFEST, PLAIN_CHECKSUM_PREFIX, CompressedCheckpoint
from engine.compression.compress import compress_checkpoint
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError
from engine.loader import checkpoint_files
from engine.sampling import SamplingParams
from tests.engine.conftest import build_checkpoint

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 3, 250]
QUIET = dict(show_progress=False, say=lambda *_: None)


def to_bf16(directory) -> None:
    path = directory / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, str(path), metadata={"format": "pt"})


def greedy(directory, **overrides) -> list[int]:
    config = dict(kv_cache_bytes=2 << 20, show_progress=False, dtype="float32", **overrides)
    llm = LLMEngine(directory, EngineConfig(**config))
    llm.add_request("a", PROMPT, GREEDY)
    tokens = []
    while llm.has_work():
        tokens += [out.token.token_id for out in llm.step()]
    return tokens


@pytest.fixture(scope="module")
def demo(tiny_model_dir, tmp_path_factory):
    """The demo Llama in bf16 (so its compressed copy is bit-identical)."""
    directory = tmp_path_factory.mktemp("hardening") / "demo"
    shutil.copytree(tiny_model_dir, directory)
    to_bf16(directory)
    return directory


def test_the_default_compress_shrinks_mixtral_experts_bit_exactly(tmp_path):
    # Mixtral keeps its experts under block_sparse_moe, not mlp: `--tensors mlp` compressed none of them.
    build_checkpoint(tmp_path / "src", "mixtral")
    to_bf16(tmp_path / "src")
    report = compress_checkpoint(tmp_path / "src", tmp_path / "c", chunk_size=64, **QUIET)
    checkpoint = CompressedCheckpoint(tmp_path / "c", checkpoint_files(tmp_path / "c"))
    source = load_file(tmp_path / "src" / "model.safetensors")
    experts = [name for name in source if ".experts." in name]
    assert experts and all(checkpoint.is_compressed(name) for name in experts)
    assert not any(checkpoint.is_compressed(name) for name in source if ".self_attn." in name)
    assert report.total.stored_bytes < report.total.bf16_bytes
    for name, tensor in source.items():
        assert torch.equal(checkpoint.read(name).view(torch.int16), tensor.view(torch.int16)), name
    expected = greedy(tmp_path / "src")
    for mode in ("decompress_on_load", "compressed_in_memory"):
        assert greedy(tmp_path / "c", weight_mode=mode) == expected, mode


def test_a_destination_that_holds_the_source_is_refused_and_the_source_survives(demo, tmp_path):
    source = tmp_path / "models" / "llama"
    shutil.copytree(demo, source)
    for destination in (tmp_path / "models", tmp_path):
        with pytest.raises(CheckpointError, match="would delete the source"):
            compress_checkpoint(source, destination, force=True, **QUIET)
    assert greedy(source) == greedy(demo)


def test_a_destination_inside_the_source_is_not_copied_into_itself(demo, tmp_path):
    source = tmp_path / "llama"
    shutil.copytree(demo, source)
    (source / "original").mkdir()
    (source / "original" / "params.json").write_text("{}")
    compress_checkpoint(source, source / "compressed", **QUIET)
    compress_checkpoint(source, source / "compressed", force=True, **QUIET)   # again, over the first copy
    written = {path.relative_to(source / "compressed").as_posix() for path in (source / "compressed").rglob("*")}
    assert "original/params.json" in written and not any(name.startswith("compressed") for name in written)
    assert sorted(p.name for p in source.iterdir() if p.name.startswith(".")) == []


def test_replacing_a_file_with_force_leaves_nothing_behind(demo, tmp_path):
    (tmp_path / "out").write_text("not a checkpoint")
    compress_checkpoint(demo, tmp_path / "out", force=True, **QUIET)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert greedy(tmp_path / "out") == greedy(demo)


def test_a_killed_compress_is_cleaned_up(demo, tmp_path, monkeypatch, capsys):
    # SIGTERM (timeout, systemd) unwinds like Ctrl-C: the half-written copy is removed.
    def killed(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the compress")

    monkeypatch.setattr(compress, "_write_weights", killed)
    with pytest.raises(SystemExit) as stopped:
        edgefire(["compress", str(demo), str(tmp_path / "out")])
    assert stopped.value.code == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    # SIGKILL leaves the copy behind: the next run for that destination removes it, and no live run's.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    abandoned, running = tmp_path / f".out.partial-{dead.pid}", tmp_path / f".out.partial-{os.getppid()}"
    for directory in (abandoned, running):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"x" * 1000)
    assert edgefire(["compress", str(demo), str(tmp_path / "out")]) == 0
    assert f"removed {abandoned}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", running.name])


def test_compressed_weights_without_their_manifest_are_a_clear_error(demo, tmp_path):
    compress_checkpoint(demo, tmp_path / "c", **QUIET)
    (tmp_path / "c" / MANIFEST).unlink()
    for mode in ("decompress_on_load", "compressed_in_memory"):
        with pytest.raises(CheckpointError, match=f"edgefire-compressed tensors .*{MANIFEST} is missing"):
            greedy(tmp_path / "c", weight_mode=mode)
    with pytest.raises(CheckpointError, match=f"{MANIFEST} is missing"):
        compress_checkpoint(tmp_path / "c", tmp_path / "again", **QUIET)
    assert not (tmp_path / "again").exists()


def rewrite_shard(path, entries=lambda header: None, data=lambda raw: raw) -> None:
    """Edit a safetensors file's header (a dict, in place) and data bytes."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8: 8 + length])
    entries(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data(raw[8 + length:]))


def test_a_flipped_byte_in_a_plain_tensor_is_caught_naming_it(demo, tmp_path):
    # `--tensors mlp` leaves attention, norms and embeddings plain: they carry a checksum too.
    compress_checkpoint(demo, tmp_path / "c", **QUIET)
    path, name = tmp_path / "c" / "model.safetensors", "model.layers.0.self_attn.q_proj.weight"
    header = json.loads(path.read_bytes()[8: 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])
    begin = header[name]["data_offsets"][0]
    rewrite_shard(path, data=lambda raw: raw[:begin + 9] + bytes([raw[begin + 9] ^ 0x40]) + raw[begin + 10:])
    for mode in ("decompress_on_load", "compressed_in_memory"):
        with pytest.raises(CheckpointError, match=f"model.safetensors: tensor '{name}' .*checksum"):
            greedy(tmp_path / "c", weight_mode=mode)


def test_a_plain_tensor_relabelled_to_another_dtype_is_caught(demo, tmp_path):
    compress_checkpoint(demo, tmp_path / "c", **QUIET)
    rewrite_shard(tmp_path / "c" / "model.safetensors", entries=lambda h: h["model.norm.weight"].update(dtype="F16"))
    with pytest.raises(CheckpointError, match="'model.norm.weight' is stored as torch.float16"):
        greedy(tmp_path / "c")


def test_a_compressed_checkpoint_without_plain_checksums_still_loads(demo, tmp_path):
    # Written before plain entries had checksums: the same format version, still read.
    compress_checkpoint(demo, tmp_path / "c", **QUIET)

    def strip(header):
        metadata = header["__metadata__"]
        for key in [key for key in metadata if key.startswith(PLAIN_CHECKSUM_PREFIX)]:
            del metadata[key]

    rewrite_shard(tmp_path / "c" / "model.safetensors", entries=strip)
    assert greedy(tmp_path / "c", weight_mode="compressed_in_memory") == greedy(demo)


def test_a_tensor_that_decodes_wrong_is_caught_naming_its_file(demo, tmp_path):
    # A changed sign bit with a payload checksum written to match: only the decoded values' checksum can
    # tell. The error names the shard, since an agent may be loading several checkpoints.
    from safetensors import safe_open
    from engine.compression.format import PARTS, part_name, payload_checksum

    compress_checkpoint(demo, tmp_path / "c", **QUIET)
    path, name = tmp_path / "c" / "model.safetensors", "model.layers.1.mlp.down_proj.weight"
    with safe_open(str(path), "pt") as f:
        metadata, tensors = f.metadata(), {key: f.get_tensor(key) for key in f.keys()}
    tensors[part_name(name, "sign_mantissa")][7] ^= 0x80
    record = json.loads(metadata["edgefire.tensor." + name])
    record["payload_xxh3"] = payload_checksum(record["shape"], record["chunk_size"], record["xxh3"],
                                              {part: tensors[part_name(name, part)] for part in PARTS})
    metadata["edgefire.tensor." + name] = json.dumps(record)
    save_file(tensors, str(path), metadata=metadata)
    for mode in ("decompress_on_load", "compressed_in_memory"):
        with pytest.raises(CheckpointError, match=f"{path}: compressed tensor '{name}' decoded to values whose"):
            greedy(tmp_path / "c", weight_mode=mode)
