"""`edgefire compress`: a checkpoint in, its compressed copy out, written atomically and verified.

Reads any checkpoint the engine loads. Floating-point matrices that are not bf16 are converted to
bf16 first (the tool says so; the copy is then not bit-identical to the source, and keeps its own
fingerprint). Vectors (biases, norm scales, a router's correction bias, attention sinks) and scalars are stored plain
in their own dtype: published bf16 checkpoints keep some in float32 on purpose (DeepSeek-V3's, GLM-4.5's and
ERNIE 4.5's expert-score correction biases pick the experts, and a rounded one picks others), and they weigh nothing. The selected tensors (`mlp`: the MLP projections, a mixture of experts' experts and
router included; `all`: every floating tensor) are compressed when that makes them smaller and
stored plain otherwise. An MXFP4 checkpoint's quantized experts (gpt-oss's `*_blocks` and `*_scales`,
engine.mxfp4) are copied as they are, listed in the manifest: 4-bit codes and power-of-two scales hardly
compress, and the engine dequantizes them at load from the copy exactly as from the source; its
quantization_config stays in config.json. Everything is written to a temporary directory beside DST, read back
through the engine's own reader (which decodes every compressed tensor and checks it), compared
with the source's checksums, and only then renamed to DST.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine import mxfp4
from engine.compression.checkpoint import MANIFEST, CompressedCheckpoint, open_checkpoint
from engine.compression.encoder import compress_tensor
from engine.compression.format import FORMAT_NAME, FORMAT_VERSION, is_vector, tensor_checksum
from engine.compression.writer import INDEX_FILE, ShardWriter
from engine.config import load_config
from engine.errors import CheckpointError

TENSOR_CHOICES = ("mlp", "all")
MAX_SHARD_BYTES = 2 << 30
_SCRATCH_PREFIX = ".{}."   # beside DST: .NAME.partial-PID while writing, .NAME.replaced-PID while swapping in
# Mixtral keeps its experts (and router) under block_sparse_moe, the other families under mlp.
_GROUPS = [("mlp", re.compile(r"\.(mlp|block_sparse_moe)\.")), ("attention", re.compile(r"\.self_attn\.")),
           ("embeddings", re.compile(r"embed_tokens|lm_head")), ("norms", re.compile(r"norm"))]
MXFP4_GROUP = "mxfp4"


def tensor_group(name: str) -> str:
    """The group a tensor's size is reported under: mlp, attention, embeddings, norms or other (and mxfp4, which
    _write_weights gives an MXFP4 checkpoint's quantized tensors)."""
    return next((group for group, pattern in _GROUPS if pattern.search(name)), "other")


@dataclass(slots=True)
class GroupSize:
    num_tensors: int = 0
    num_compressed: int = 0
    source_bytes: int = 0    # as the source stored them
    bf16_bytes: int = 0      # as bf16: the baseline the compression is measured against
    stored_bytes: int = 0    # in the compressed checkpoint

    def add(self, other: GroupSize) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def saving(self) -> float:
        return 1 - self.stored_bytes / self.bf16_bytes if self.bf16_bytes else 0.0


@dataclass(slots=True)
class CompressionReport:
    destination: Path
    groups: dict[str, GroupSize] = field(default_factory=dict)
    converted: dict[str, int] = field(default_factory=dict)   # source dtype -> tensors converted to bf16
    mxfp4_tensors: list[str] = field(default_factory=list)    # copied as they are (group mxfp4)
    seconds: float = 0.0

    @property
    def total(self) -> GroupSize:
        total = GroupSize()
        for size in self.groups.values():
            total.add(size)
        return total

    def table(self) -> str:
        lines = [f"{'group':<12}{'tensors':>9}{'compressed':>12}{'bf16 MiB':>11}{'stored MiB':>12}{'saved':>8}"]
        for name, size in [*sorted(self.groups.items()), ("whole model", self.total)]:
            lines.append(f"{name:<12}{size.num_tensors:>9}{size.num_compressed:>12}{size.bf16_bytes / 2**20:>11.1f}"
                         f"{size.stored_bytes / 2**20:>12.1f}{size.saving:>8.1%}")
        if self.mxfp4_tensors:
            lines.append(f"{MXFP4_GROUP}: the MXFP4 experts' blocks and scales, copied as they are (4-bit data hardly "
                         f"compresses) and counted at their stored size")
        return "\n".join(lines)


def compress_checkpoint(src: str | Path, dst: str | Path, tensors: str = "mlp", chunk_size: int | None = None,
                        force: bool = False, show_progress: bool = True, say=print,
                        max_shard_bytes: int = MAX_SHARD_BYTES) -> CompressionReport:
    from engine.fingerprint import weight_identity
    from engine.loader import checkpoint_files

    src, dst = Path(src), Path(dst)
    if tensors not in TENSOR_CHOICES:
        raise ValueError(f"tensors must be one of {', '.join(TENSOR_CHOICES)}, got {tensors!r}")
    load_config(src)   # fails clearly unless SRC is a checkpoint the engine loads
    quantized = mxfp4.is_quantized(json.loads((src / "config.json").read_text()))
    files = checkpoint_files(src)
    if open_checkpoint(src, files) is not None:
        raise CheckpointError(f"{src} is already a compressed checkpoint ({MANIFEST}); compress the original instead")
    if dst.resolve() == src.resolve():
        raise CheckpointError("the destination must differ from the source")
    if src.resolve().is_relative_to(dst.resolve()):
        raise CheckpointError(f"{dst} holds the source checkpoint {src}: replacing it would delete the source; "
                              f"choose a destination outside it")
    if dst.exists() and not force:
        raise CheckpointError(f"{dst} already exists; choose another destination or pass --force to replace it")
    started = time.perf_counter()
    report = CompressionReport(dst)
    _remove_abandoned(dst, say)
    partial = dst.parent / f"{_SCRATCH_PREFIX.format(dst.name)}partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        _copy_other_files(src, partial, dst)
        checksums = _write_weights(files, partial, tensors, chunk_size, max_shard_bytes, report, show_progress,
                                   quantized)
        if report.converted:
            say("converted to bfloat16 before compressing: " + ", ".join(
                f"{count} {dtype} tensors" for dtype, count in sorted(report.converted.items()))
                + " (the compressed copy equals the bf16 conversion bit for bit, not the source)")
        manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "tensors": tensors,
                    "source_weights": None if report.converted else weight_identity(src)}
        if report.mxfp4_tensors:
            manifest["mxfp4_tensors"] = sorted(report.mxfp4_tensors)
            if tensors == "mlp":
                say(f"the {len(report.mxfp4_tensors)} MXFP4 expert tensors were copied as they are, so --tensors mlp "
                    f"compressed only the router and the experts' biases; --tensors all also compresses attention, "
                    f"embeddings and the LM head")
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _verify(partial, checksums, show_progress)
        _replace(partial, dst)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    report.seconds = time.perf_counter() - started
    return report


def _copy_other_files(src: Path, directory: Path, dst: Path) -> None:
    """Config, tokenizer, generation config and anything else that is not weights, into directory.
    A destination inside the source (and its scratch directories) is not copied into itself."""
    target, scratch = dst.resolve(), _SCRATCH_PREFIX.format(dst.name)

    def skipped(folder: str, names: list[str]) -> list[str]:
        here = Path(folder).resolve()
        return [name for name in names if here / name == target or here == target.parent and name.startswith(scratch)]

    for entry in src.iterdir():
        if entry.suffix == ".safetensors" or entry.name in (INDEX_FILE, MANIFEST) or entry.name.startswith("."):
            continue
        if skipped(str(src), [entry.name]):
            continue
        if entry.is_dir():
            shutil.copytree(entry, directory / entry.name, ignore=skipped)
        else:
            shutil.copy2(entry, directory / entry.name)


def _write_weights(files: dict[str, Path], directory: Path, choice: str, chunk_size: int | None, max_shard_bytes: int,
                   report: CompressionReport, show_progress: bool, quantized: bool = False) -> dict[str, str]:
    """Compress or copy every tensor into shards; returns each tensor's checksum (as written: bf16, or a vector in its own dtype). quantized: the
    checkpoint is MXFP4, whose blocks and scales (uint8) are copied as they are and reported as group mxfp4."""
    handles = {path: safe_open(str(path), framework="pt", device="cpu") for path in sorted(set(files.values()))}
    writer = ShardWriter(directory, max_shard_bytes)
    checksums = {}
    total = sum(_nbytes(handles[path], name) for name, path in files.items())
    with tqdm(total=total, unit="B", unit_scale=True, desc="compressing", disable=not show_progress) as bar:
        for name, path in sorted(files.items(), key=lambda item: (str(item[1]), item[0])):
            tensor = handles[path].get_tensor(name)
            size = GroupSize(num_tensors=1, source_bytes=tensor.numel() * tensor.element_size())
            # uint8, so stored plain as they are below, like any integer tensor; reported apart
            group = MXFP4_GROUP if quantized and mxfp4.is_part(name, tensor.dtype) else tensor_group(name)
            if group == MXFP4_GROUP:
                report.mxfp4_tensors.append(name)
            if tensor.is_floating_point() and tensor.dtype != torch.bfloat16 and not is_vector(tensor):
                key = str(tensor.dtype).removeprefix("torch.")
                report.converted[key] = report.converted.get(key, 0) + 1
                tensor = tensor.to(torch.bfloat16)
            size.bf16_bytes = tensor.numel() * tensor.element_size()
            compressed = None
            if tensor.dtype == torch.bfloat16 and (choice == "all" or group == "mlp"):
                compressed = compress_tensor(name, tensor, chunk_size)
            if compressed is not None:
                writer.add_compressed(compressed)
                size.num_compressed, size.stored_bytes = 1, compressed.nbytes
            else:
                writer.add_plain(name, tensor)
                size.stored_bytes = size.bf16_bytes
            checksums[name] = tensor_checksum(tensor.contiguous())
            report.groups.setdefault(group, GroupSize()).add(size)
            bar.update(size.source_bytes)
    writer.finish()
    return checksums


def _nbytes(handle, name: str) -> int:
    sliced = handle.get_slice(name)
    numel = 1
    for dim in sliced.get_shape():
        numel *= dim
    return numel * {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}.get(sliced.get_dtype(), 1)


def _verify(directory: Path, checksums: dict[str, str], show_progress: bool) -> None:
    """Read every tensor back as the engine would and compare it with what was written."""
    from engine.loader import checkpoint_files

    checkpoint = CompressedCheckpoint(directory, checkpoint_files(directory))
    missing = set(checksums) - set(checkpoint.names())
    if missing:
        raise CheckpointError(f"verification failed: {sorted(missing)[:5]} missing from the written checkpoint")
    for name in tqdm(sorted(checksums), desc="verifying", unit="tensor", disable=not show_progress):
        if tensor_checksum(checkpoint.read(name).contiguous()) != checksums[name]:
            raise CheckpointError(f"verification failed: tensor {name!r} does not read back bit-exactly; "
                                  f"nothing was written to the destination")


def _replace(partial: Path, dst: Path) -> None:
    """Move the finished directory into place; an existing DST (--force) is swapped out, then removed."""
    if not dst.exists():
        partial.rename(dst)
        return
    old = dst.parent / f"{_SCRATCH_PREFIX.format(dst.name)}replaced-{os.getpid()}"
    dst.rename(old)
    partial.rename(dst)
    _remove(old)


def _remove_abandoned(dst: Path, say) -> None:
    """Delete the scratch directories of earlier runs for dst whose process is gone (killed, or the machine
    went down): a checkpoint-sized hidden directory each. A replaced old dst is kept while dst is missing:
    the run died between the two renames and it is the only copy."""
    if not dst.parent.is_dir():
        return
    for kind in ("partial", "replaced") if dst.exists() else ("partial",):
        for path in dst.parent.glob(glob.escape(f"{_SCRATCH_PREFIX.format(dst.name)}{kind}-") + "*"):
            pid = path.name.rpartition("-")[2]
            if pid.isdigit() and not _alive(int(pid)):
                _remove(path)
                say(f"removed {path}, left by an interrupted edgefire compress")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
