"""Compressed checkpoints end to end: `edgefire compress`, loading in both weight modes, bad files.

The originals are bf16 random-weight Llama and Qwen3 checkpoints saved by transformers, so the
compressed copies must give exactly the original's tokens; the CLI tests use the demo model (with
its tokenizer) converted to bf16.
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.conftest import build_checkpoint
from deploy.cli import main as edgefire
from engine.compression.checkpoint import MANIFEST, CompressedCheckpoint
from engine.compression.compress import compress_checkpoint
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError
from engine.loader import checkpoint_files
from engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = {"a": [5, 17, 42, 99, 3, 250], "b": list(range(60, 81))}
MODES = ["decompress_on_load", "compressed_in_memory"]


def to_bf16(directory) -> None:
    path = directory / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request, tmp_path_factory):
    """(original bf16 checkpoint, its compressed copy)."""
    original = tmp_path_factory.mktemp(f"{request.param}-bf16")
    build_checkpoint(original, request.param)
    to_bf16(original)
    compressed = original.parent / f"{original.name}-compressed"
    compress_checkpoint(original, compressed, chunk_size=64, show_progress=False, say=lambda *_: None)
    return original, compressed


@pytest.fixture(scope="module")
def demo_bf16(tiny_model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("demo-bf16") / "model"
    shutil.copytree(tiny_model_dir, directory)
    to_bf16(directory)
    return directory


@pytest.fixture(scope="module")
def demo_pair(demo_bf16):
    """The bf16 demo Llama (it has a tokenizer) and its compressed copy."""
    compressed = demo_bf16.parent / "compressed"
    compress_checkpoint(demo_bf16, compressed, show_progress=False, say=lambda *_: None)
    return demo_bf16, compressed


def engine(directory, **overrides) -> LLMEngine:
    config = dict(kv_cache_bytes=2 << 20, show_progress=False, dtype="float32")
    return LLMEngine(directory, EngineConfig(**{**config, **overrides}))


def greedy(llm: LLMEngine) -> dict[str, list[int]]:
    outputs = {rid: [] for rid in PROMPTS}
    for rid, prompt in PROMPTS.items():
        llm.add_request(rid, prompt, GREEDY)
    while llm.has_work():
        for out in llm.step():
            outputs[out.request_id].append(out.token.token_id)
    return outputs


def test_compressed_checkpoint_generates_the_original_tokens_in_both_modes(pair):
    original, compressed = pair
    expected = greedy(engine(original))
    for mode in MODES:
        assert greedy(engine(compressed, weight_mode=mode)) == expected, mode


def test_compressed_in_memory_gives_the_saved_memory_to_the_kv_cache(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    # MLPs big enough that the savings beat the decode buffer (one layer's weights) and the decode
    # tables (256 KiB per distinct code): on real models both are a fraction of a percent.
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=128)).to(torch.bfloat16).save_pretrained(tmp_path / "o")
    compress_checkpoint(tmp_path / "o", tmp_path / "c", show_progress=False)
    plain, streamed = engine(tmp_path / "o"), engine(tmp_path / "c", weight_mode="compressed_in_memory")
    gained = streamed.stats().num_kv_blocks_from_compression
    assert gained > 0 and plain.stats().num_kv_blocks_from_compression == 0
    assert streamed.stats().num_blocks_total == plain.stats().num_blocks_total + gained
    assert type(plain.model.weights.layers) is list   # the plain forward keeps its plain layer list


def test_a_compressed_copy_shares_its_originals_fingerprint_and_kv(demo_pair):
    original, compressed = demo_pair
    source, target = engine(original), engine(compressed, weight_mode="compressed_in_memory")
    assert source.fingerprint == target.fingerprint
    source.add_request("x", PROMPTS["b"], GREEDY, prefill_only=True)
    (first,) = source.step()
    target.import_kv("x", source.export_kv(first.kv_handle), GREEDY, [first.token.token_id])
    rest = []
    while target.has_work():
        rest += [o.token.token_id for o in target.step()]
    assert [first.token.token_id] + rest == greedy(engine(original))["b"]


def test_compress_prints_group_and_model_sizes_and_refuses_to_overwrite(demo_pair, tmp_path, capsys):
    original, _ = demo_pair
    destination = tmp_path / "out"
    assert edgefire(["compress", str(original), str(destination), "--chunk-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "mlp" in out and "whole model" in out and "verified bit-exact" in out
    assert json.loads((destination / MANIFEST).read_text())["source_weights"] is not None
    assert edgefire(["compress", str(original), str(destination)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert edgefire(["compress", str(destination), str(tmp_path / "again")]) == 2
    assert "already a compressed checkpoint" in capsys.readouterr().err


def test_a_failed_compress_leaves_nothing_behind(demo_pair, tmp_path, monkeypatch):
    from engine.compression import compress
    original, _ = demo_pair

    def broken_verify(*args):
        raise CheckpointError("verification failed: simulated")

    monkeypatch.setattr(compress, "_verify", broken_verify)
    with pytest.raises(CheckpointError, match="simulated"):
        compress_checkpoint(original, tmp_path / "out", show_progress=False)
    assert list(tmp_path.iterdir()) == []


def test_all_tensors_mode_compresses_attention_and_embeddings_too(demo_pair, tmp_path):
    original, _ = demo_pair
    report = compress_checkpoint(original, tmp_path / "all", tensors="all", chunk_size=64, show_progress=False)
    assert report.groups["attention"].num_compressed > 0 and report.groups["embeddings"].num_compressed > 0
    assert greedy(engine(tmp_path / "all")) == greedy(engine(original))


# -- the CLI on the demo model, and non-bf16 sources --------------------------------------------


def test_edgefire_generate_on_a_compressed_demo_model_matches_the_original(demo_pair, capsys):
    original, compressed = demo_pair
    texts = {}
    for name, directory, mode in [("original", original, "decompress_on_load"),
                                  ("on-load", compressed, "decompress_on_load"),
                                  ("in-memory", compressed, "compressed_in_memory")]:
        args = ["generate", "--model", str(directory), "--prompt", "The edge network", "--max-tokens", "12",
                "--dtype", "float32", "--weight-mode", mode]
        assert edgefire(args) == 0
        texts[name] = capsys.readouterr().out
    assert texts["on-load"] == texts["original"] and texts["in-memory"] == texts["original"]


def test_a_float32_source_is_converted_and_keeps_its_own_fingerprint(tiny_model_dir, tmp_path):
    said = []
    compress_checkpoint(tiny_model_dir, tmp_path / "c", show_progress=False, say=said.append)
    assert "converted to bfloat16" in said[0] and "float32" in said[0]
    assert json.loads((tmp_path / "c" / MANIFEST).read_text())["source_weights"] is None
    assert engine(tmp_path / "c").fingerprint != engine(tiny_model_dir).fingerprint


def test_float32_vectors_of_a_bf16_checkpoint_are_kept_as_they_are(demo_bf16, tmp_path):
    # Published bf16 checkpoints keep some vectors in float32 (DeepSeek-V3's and GLM-4.5's expert-score correction
    # biases, which pick the experts): the copy keeps them bit for bit, so it is still the source's exact copy.
    source = tmp_path / "mixed"
    shutil.copytree(demo_bf16, source)
    weights = load_file(source / "model.safetensors")
    name = next(n for n, t in weights.items() if t.dim() == 1)
    weights[name] = weights[name].float() + 1e-3 * torch.arange(weights[name].numel())   # not a bf16 value
    save_file(weights, str(source / "model.safetensors"), metadata={"format": "pt"})
    said = []
    compress_checkpoint(source, tmp_path / "c", show_progress=False, say=said.append)
    assert not [line for line in said if "converted" in line]
    assert json.loads((tmp_path / "c" / MANIFEST).read_text())["source_weights"] is not None
    assert engine(tmp_path / "c").fingerprint == engine(source).fingerprint
    copy = CompressedCheckpoint(tmp_path / "c", checkpoint_files(tmp_path / "c")).read(name)
    assert copy.dtype == torch.float32 and torch.equal(copy, weights[name])


# -- damaged compressed checkpoints -------------------------------------------------------------


@pytest.fixture
def damaged(demo_pair, tmp_path):
    directory = tmp_path / "damaged"
    shutil.copytree(demo_pair[1], directory)
    return directory


def part_offset(path, entry: str) -> int:
    """File offset of a safetensors entry's first data byte."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8: 8 + header_len])
    return 8 + header_len + header[entry]["data_offsets"][0]


@pytest.mark.parametrize("part", ["exponent_stream", "sign_mantissa", "chunk_offsets", "palette"])
def test_a_flipped_byte_is_caught_at_load_naming_the_tensor(damaged, part):
    name = "model.layers.1.mlp.down_proj.weight"
    path = damaged / "model.safetensors"
    data = bytearray(path.read_bytes())
    entry = f"{name}.__efc.{part}"
    raw_header = json.loads(data[8: 8 + struct.unpack("<Q", data[:8])[0]])
    start, end = raw_header[entry]["data_offsets"]
    data[part_offset(path, entry) + (end - start) // 2] ^= 0x04
    path.write_bytes(bytes(data))
    for mode in MODES:
        with pytest.raises(CheckpointError, match=f"'{name}'.*(checksum|corrupt)"):
            engine(damaged, weight_mode=mode)


def test_a_changed_record_is_caught_naming_the_tensor(damaged):
    path = damaged / "model.safetensors"
    data = path.read_bytes()
    record = b'\\"chunk_size\\": 256'   # the demo's MLP tensors are small: auto chunk size 256
    assert record in data
    path.write_bytes(data.replace(record, b'\\"chunk_size\\": 128', 1))
    with pytest.raises(CheckpointError, match="compressed tensor 'model.layers.*(checksum|chunk)"):
        engine(damaged)


def test_a_truncated_file_is_caught(damaged):
    path = damaged / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-300])
    with pytest.raises(CheckpointError, match="model.safetensors.*(corrupt|truncated|unreadable)"):
        engine(damaged)


def test_another_format_version_is_refused(damaged):
    manifest = json.loads((damaged / MANIFEST).read_text())
    manifest["format_version"] = 3
    (damaged / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format version 3; this edgefire reads versions 1, 2"):
        engine(damaged)
    manifest["format_version"] = 2
    (damaged / MANIFEST).write_text(json.dumps(manifest))
    path = damaged / "model.safetensors"
    written = path.read_bytes()
    path.write_bytes(written.replace(b'"edgefire.format_version":"2"', b'"edgefire.format_version":"7"', 1))
    with pytest.raises(CheckpointError, match="model.safetensors: compressed with format version '7'"):
        engine(damaged)


def test_a_copy_written_in_format_1_still_reads(demo_pair, tmp_path):
    # Version 1 (every floating tensor bf16) is version 2 without own-dtype vectors: an older copy keeps serving.
    original, compressed = demo_pair
    older = tmp_path / "v1"
    shutil.copytree(compressed, older)
    manifest = json.loads((older / MANIFEST).read_text())
    (older / MANIFEST).write_text(json.dumps({**manifest, "format_version": 1}))
    for path in older.glob("*.safetensors"):
        path.write_bytes(path.read_bytes().replace(b'"edgefire.format_version":"2"', b'"edgefire.format_version":"1"', 1))
    assert greedy(engine(older)) == greedy(engine(original))
