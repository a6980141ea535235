"""`edgefire compress` on a gpt-oss checkpoint with MXFP4 experts: the bf16 tensors compressed, the MXFP4
blocks and scales copied byte for byte, and the engine loading the copy to the original's tokens and
to the logits transformers computes from the original; a copy whose MXFP4 tensors are missing or of
the wrong dtype or shape is refused naming the tensor.

The checkpoint is test_gpt_oss's random-weight gpt-oss, every tensor in bf16, its experts quantized to
MXFP4 by the format's definition and saved under the released checkpoints' names.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deploy.cli import main as edgefire
from engine.compression.checkpoint import MANIFEST, PLAIN_CHECKSUM_PREFIX, CompressedCheckpoint
from engine.compression.compress import compress_checkpoint
from engine.compression.format import tensor_checksum
from engine.errors import CheckpointError
from engine.loader import checkpoint_files
from tests.engine.test_compression_checkpoint import engine, greedy, to_bf16
from tests.engine.test_gpt_oss import _reference, _save, _write_mxfp4
from tests.engine.test_moe import check_against_transformers, random_prompts

transformers = pytest.importorskip("transformers")

MODES = ["decompress_on_load", "compressed_in_memory"]
MXFP4_SUFFIXES = ("_blocks", "_scales")
QUIET = dict(show_progress=False, say=lambda *_: None)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    bf16 = tmp_path_factory.mktemp("gpt-oss-bf16")
    _save(bf16)
    to_bf16(bf16)
    directory = tmp_path_factory.mktemp("gpt-oss-mxfp4") / "model"
    _write_mxfp4(bf16, directory)
    return directory


@pytest.fixture(scope="module")
def compressed(original):
    """The original compressed with --tensors all: attention, embeddings and LM head too."""
    destination = original.parent / "compressed"
    report = compress_checkpoint(original, destination, tensors="all", chunk_size=64, **QUIET)
    return destination, report


def test_the_mxfp4_tensors_are_copied_byte_for_byte_and_the_quantization_config_kept(original, compressed):
    destination, report = compressed
    source, written = load_file(original / "model.safetensors"), load_file(destination / "model.safetensors")
    quantized = sorted(name for name in source if name.endswith(MXFP4_SUFFIXES))
    assert len(quantized) == 3 * 4   # gate_up and down, blocks and scales, in each of the three layers
    for name in quantized:
        assert written[name].dtype == torch.uint8 and torch.equal(written[name], source[name]), name
    assert json.loads((destination / MANIFEST).read_text())["mxfp4_tensors"] == quantized
    assert report.mxfp4_tensors and sorted(report.mxfp4_tensors) == quantized
    mxfp4 = report.groups["mxfp4"]
    assert mxfp4.num_tensors == 12 and mxfp4.num_compressed == 0 and mxfp4.stored_bytes == mxfp4.source_bytes
    read = lambda directory: json.loads((directory / "config.json").read_text())["quantization_config"]
    assert read(destination) == read(original)


def test_the_bf16_tensors_are_compressed_and_decode_bit_exactly(original, compressed):
    destination, report = compressed
    source = load_file(original / "model.safetensors")
    checkpoint = CompressedCheckpoint(destination, checkpoint_files(destination))
    for name in ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.2.self_attn.o_proj.weight"]:
        assert checkpoint.is_compressed(name), name
    for group in ("attention", "embeddings"):
        assert report.groups[group].stored_bytes < report.groups[group].bf16_bytes, group
    for name, tensor in source.items():
        if name.endswith(MXFP4_SUFFIXES):
            continue
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(checkpoint.read(name).view(torch.int16), tensor.view(torch.int16)), name


def test_the_compressed_copy_generates_the_originals_tokens_in_both_modes(original, compressed):
    destination, _ = compressed
    expected = greedy(engine(original))
    for mode in MODES:
        llm = engine(destination, weight_mode=mode)
        assert greedy(llm) == expected, mode
    # a bit-exact copy keeps the source's fingerprint, so the two exchange KV
    assert engine(destination).fingerprint == engine(original).fingerprint


def test_the_compressed_copy_loads_to_the_logits_transformers_computes_from_the_original(original, compressed):
    reference = _reference(original, quantization_config=transformers.Mxfp4Config(dequantize=True))
    check_against_transformers(compressed[0], reference, random_prompts([7, 26], seed=9), max_tokens=5)


def test_edgefire_compress_says_the_mxfp4_experts_are_copied_as_they_are(original, tmp_path, capsys):
    destination = tmp_path / "out"
    assert edgefire(["compress", str(original), str(destination), "--chunk-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "mxfp4" in out and "copied as they are" in out and "--tensors all" in out
    assert "verified bit-exact" in out
    assert greedy(engine(destination)) == greedy(engine(original))


# -- damaged copies -----------------------------------------------------------------------------------


def rewrite(directory, change) -> None:
    """The copy's weights with change(tensors, metadata) applied, each plain entry's checksum recomputed as a
    writer would have recorded it (so the MXFP4 checks, not the checksum, are what must catch the damage)."""
    path = directory / "model.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(path)
    change(tensors)
    for name, tensor in tensors.items():
        if PLAIN_CHECKSUM_PREFIX + name in metadata:
            metadata[PLAIN_CHECKSUM_PREFIX + name] = tensor_checksum(tensor.contiguous())
    save_file(tensors, str(path), metadata=metadata)


@pytest.fixture
def damaged(compressed, tmp_path):
    directory = tmp_path / "damaged"
    shutil.copytree(compressed[0], directory)
    return directory


SCALES = "model.layers.1.mlp.experts.down_proj_scales"
BLOCKS = "model.layers.0.mlp.experts.gate_up_proj_blocks"


def test_a_copy_missing_an_mxfp4_tensor_is_refused_naming_it(damaged):
    rewrite(damaged, lambda tensors: tensors.pop(SCALES))
    with pytest.raises(CheckpointError, match=f"MXFP4 tensor '{SCALES}'.* is in no weight file"):
        engine(damaged)
    # also when the manifest no longer lists it: the loader misses it
    manifest = json.loads((damaged / MANIFEST).read_text())
    manifest["mxfp4_tensors"].remove(SCALES)
    (damaged / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"missing tensor '{SCALES}'"):
        engine(damaged)


def test_a_copy_with_an_mxfp4_tensor_of_another_dtype_is_refused_naming_it(damaged):
    rewrite(damaged, lambda tensors: tensors.update({BLOCKS: tensors[BLOCKS].to(torch.int16)}))
    with pytest.raises(CheckpointError, match=f"MXFP4 tensor '{BLOCKS}' is stored as I16"):
        engine(damaged)


def test_a_copy_with_an_mxfp4_tensor_of_another_shape_is_refused_naming_it(damaged):
    rewrite(damaged, lambda tensors: tensors.update({BLOCKS: tensors[BLOCKS][:, :-1].contiguous()}))
    for mode in MODES:
        with pytest.raises(CheckpointError, match=f"tensor '{BLOCKS}' has shape .*config implies"):
            engine(damaged, weight_mode=mode)


def test_a_copy_with_a_changed_mxfp4_byte_is_refused_naming_the_tensor(damaged):
    """A flipped bit in the 4-bit data would load as other weights: its checksum catches it."""
    path = damaged / "model.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(path)
    tensors[SCALES][0, 0, 0] ^= 1
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match=f"'{SCALES}'.*does not match its checksum"):
        engine(damaged)
