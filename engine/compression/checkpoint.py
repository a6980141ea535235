"""Reading a compressed checkpoint directory (FORMAT.md): its manifest, and any tensor by name.

The reader maps each logical tensor name to the shard that holds it, plain or compressed, so the
engine's loader asks for "model.layers.3.mlp.down_proj.weight" and never sees parts. A compressed
tensor's parts are validated (structure and payload checksum) as they are read, and a decoded
tensor is checked against the original's checksum, so a corrupt file fails at load naming the
tensor and is never turned into wrong weights.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.compression.format import (FORMAT_NAME, PARTS, READABLE_VERSIONS, CompressedFormatError, CompressedTensor,
                                       from_record, is_vector, part_name, split_part_name, tensor_checksum)

MANIFEST = "compression.json"
SHARD_VERSION_KEY = "edgefire.format_version"
RECORD_PREFIX = "edgefire.tensor."
PLAIN_CHECKSUM_PREFIX = "edgefire.plain_xxh3."   # a plain entry's checksum (checkpoints written before it have none)
PLAIN_DTYPE_PREFIX = "edgefire.plain_dtype."     # a floating vector kept in its source's dtype: that dtype (format 2)


@dataclass(slots=True)
class Manifest:
    format_version: int
    # the source's weight identity (engine/fingerprint.py) when the weights decode bit-identical
    source_weights: list[str] | None
    tensors: str                       # mlp | all
    # an MXFP4 checkpoint's blocks and scales (engine.mxfp4), copied as they are: plain uint8 entries
    mxfp4_tensors: list[str] = field(default_factory=list)


def is_compressed(model_dir: str | Path) -> bool:
    return (Path(model_dir) / MANIFEST).is_file()


def open_checkpoint(model_dir: str | Path, files: dict[str, Path]) -> CompressedCheckpoint | None:
    """The reader of a compressed checkpoint, None for a plain one (files: as for CompressedCheckpoint).
    Weights holding compressed parts without the manifest beside them are an error naming what is
    missing, not a plain checkpoint that lacks its MLP weights."""
    if is_compressed(model_dir):
        return CompressedCheckpoint(model_dir, files)
    part = next((name for name in files if split_part_name(name) is not None), None)
    if part is not None:
        raise CompressedFormatError(
            f"{model_dir}: the weights hold edgefire-compressed tensors ({part!r} in {Path(files[part]).name}) but "
            f"{MANIFEST} is missing or not a file; copy it back from where the checkpoint came from, or compress "
            f"the original again (edgefire compress SRC DST)")
    return None


def read_manifest(model_dir: str | Path) -> Manifest:
    path = Path(model_dir) / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CompressedFormatError(f"{path}: unreadable ({exc}); compress the checkpoint again") from exc
    found = raw.get("format") if isinstance(raw, dict) else raw
    if found != FORMAT_NAME:
        raise CompressedFormatError(f"{path}: not an edgefire compressed checkpoint (format {found!r}, "
                                    f"expected {FORMAT_NAME!r})")
    version = _check_version(raw.get("format_version"), str(path))
    source = raw.get("source_weights")
    if source is not None and not (isinstance(source, list) and all(isinstance(s, str) for s in source)):
        raise CompressedFormatError(f"{path}: source_weights must be a list of strings (the source's weight "
                                    f"files, as engine/fingerprint.py writes them) or null")
    mxfp4_tensors = raw.get("mxfp4_tensors", [])
    if not (isinstance(mxfp4_tensors, list) and all(isinstance(name, str) for name in mxfp4_tensors)):
        raise CompressedFormatError(f"{path}: mxfp4_tensors must be a list of tensor names (the MXFP4 blocks and "
                                    f"scales copied as they are)")
    return Manifest(version, source, str(raw.get("tensors")), mxfp4_tensors)


def _check_version(version, where: str) -> int:
    """The format version, one this edgefire reads (format.READABLE_VERSIONS)."""
    readable = {str(v): v for v in READABLE_VERSIONS}
    if str(version) not in readable:
        raise CompressedFormatError(
            f"{where}: compressed with format version {version!r}; this edgefire reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}. Compress the original checkpoint again with this edgefire "
            f"(edgefire compress SRC DST), or run a newer edgefire")
    return readable[str(version)]


class CompressedCheckpoint:
    """Tensors of a compressed checkpoint by logical name, from shards opened once each."""

    def __init__(self, model_dir: str | Path, files: dict[str, Path]):
        """files: every safetensors entry name -> the shard holding it (as engine.loader finds them)."""
        self.model_dir = Path(model_dir)
        self.manifest = read_manifest(self.model_dir)
        self.handles: dict[Path, object] = {}
        self.plain: dict[str, Path] = {}
        self.plain_checksums: dict[str, str] = {}
        self.own_dtypes: dict[str, str] = {}   # vectors kept in their source's dtype -> that dtype
        self.compressed: dict[str, tuple[Path, dict]] = {}
        for shard in sorted(set(files.values())):
            handle = self._handle(shard)
            metadata = handle.metadata() or {}
            _check_version(metadata.get(SHARD_VERSION_KEY), str(shard))
            for key in handle.keys():
                split = split_part_name(key)
                if split is None:
                    self.plain[key] = shard
                    if PLAIN_CHECKSUM_PREFIX + key in metadata:
                        self.plain_checksums[key] = metadata[PLAIN_CHECKSUM_PREFIX + key]
                    if PLAIN_DTYPE_PREFIX + key in metadata:
                        self.own_dtypes[key] = metadata[PLAIN_DTYPE_PREFIX + key]
                elif split[0] not in self.compressed:
                    self.compressed[split[0]] = (shard, self._record(shard, metadata, split[0]))
        self._check_mxfp4()

    def _check_mxfp4(self) -> None:
        """The MXFP4 tensors the manifest lists are plain uint8 entries, as compress copied them from the source."""
        for name in self.manifest.mxfp4_tensors:
            if name in self.compressed:
                raise CompressedFormatError(f"{self.compressed[name][0]}: MXFP4 tensor {name!r} is stored compressed; "
                                            f"{MANIFEST} lists it as copied as it is: the checkpoint is corrupt")
            if name not in self.plain:
                raise CompressedFormatError(f"{self.model_dir}: MXFP4 tensor {name!r}, listed in {MANIFEST}, is in no "
                                            f"weight file: the checkpoint is incomplete; compress the original again")
            dtype = self._handle(self.plain[name]).get_slice(name).get_dtype()
            if dtype != "U8":
                raise CompressedFormatError(f"{self.plain[name]}: MXFP4 tensor {name!r} is stored as {dtype}; MXFP4 "
                                            f"blocks and scales are uint8 (U8): the checkpoint is corrupt")

    def names(self) -> list[str]:
        return [*self.plain, *self.compressed]

    def has(self, name: str) -> bool:
        return name in self.plain or name in self.compressed

    def is_compressed(self, name: str) -> bool:
        return name in self.compressed

    def read_compressed(self, name: str) -> CompressedTensor:
        """The tensor's parts (CPU), validated against the format and the payload checksum."""
        shard, record = self.compressed[name]
        handle = self._handle(shard)
        parts = {}
        for part in PARTS:
            try:
                parts[part] = handle.get_tensor(part_name(name, part))
            except (SafetensorError, OSError, ValueError) as exc:
                raise CompressedFormatError(f"{shard}: compressed tensor {name!r} is missing part {part!r} ({exc}); "
                                            f"the checkpoint is corrupt or truncated") from exc
        with self._naming_shard(name):
            return from_record(name, record, parts)

    def read_plain(self, name: str) -> torch.Tensor:
        """A tensor stored plain, checked against its checksum when the file records one."""
        shard = self.plain[name]
        try:
            tensor = self._handle(shard).get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CompressedFormatError(f"{shard}: cannot read tensor {name!r} ({exc})") from exc
        # A vector or a scalar (compress converts matrices only), as its source had it
        own_dtype = is_vector(tensor) and self.own_dtypes.get(name) == str(tensor.dtype)
        if tensor.is_floating_point() and tensor.dtype != torch.bfloat16 and not own_dtype:
            raise CompressedFormatError(f"{shard}: tensor {name!r} is stored as {tensor.dtype}; a compressed "
                                        f"checkpoint stores floating-point tensors in bfloat16 (vectors and scalars "
                                        f"as their source had them): it is corrupt")
        expected = self.plain_checksums.get(name)
        if expected is not None and tensor_checksum(tensor) != expected:
            raise CompressedFormatError(f"{shard}: tensor {name!r} (stored plain) does not match its checksum: the "
                                        f"checkpoint is corrupt; compress it again from the original")
        return tensor

    def read(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        """The tensor as stored before compression (bf16 for compressed ones), on device."""
        if name not in self.compressed:
            tensor = self.read_plain(name)
            return tensor if device is None else tensor.to(device)
        from engine.compression.decode import decompress_verified
        tensor = self.read_compressed(name)
        with self._naming_shard(name):
            return decompress_verified(tensor, device or torch.device("cpu"))

    def check_decodes(self, t: CompressedTensor, device: torch.device) -> None:
        """Decode t (read from here, parts on device) and check it against the original's checksum."""
        from engine.compression.decode import decompress_verified
        with self._naming_shard(t.name):
            decompress_verified(t, device)

    @contextmanager
    def _naming_shard(self, name: str):
        """Format errors of a tensor name the shard holding it: an agent may load several checkpoints."""
        try:
            yield
        except CompressedFormatError as exc:
            raise CompressedFormatError(f"{self.compressed[name][0]}: {exc}") from exc

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start .. stop-1 of a tensor (CPU; bf16 for compressed ones), decoding only the chunks
        that hold them: a tensor-parallel rank's shard of a row-split weight. A plain tensor's rows are
        not checked: its checksum covers the whole tensor."""
        if name not in self.compressed:
            return self._handle(self.plain[name]).get_slice(name)[start:stop]
        from engine.compression.decode import decompress_rows
        return decompress_rows(self.read_compressed(name), start, stop)

    def _handle(self, shard: Path):
        if shard not in self.handles:
            try:
                self.handles[shard] = safe_open(str(shard), framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError) as exc:
                raise CompressedFormatError(f"{shard}: unreadable safetensors file ({exc}); the checkpoint is "
                                            f"corrupt or truncated") from exc
        return self.handles[shard]

    @staticmethod
    def _record(shard: Path, metadata: dict, name: str) -> dict:
        text = metadata.get(RECORD_PREFIX + name)
        if text is None:
            raise CompressedFormatError(f"{shard}: compressed tensor {name!r} has no record in the file's metadata")
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CompressedFormatError(f"{shard}: the record of compressed tensor {name!r} is not JSON ({exc})") from exc
        if not isinstance(record, dict):
            raise CompressedFormatError(f"{shard}: the record of compressed tensor {name!r} is not an object")
        return record


def verify_output(t: CompressedTensor, bits: torch.Tensor) -> None:
    """Raise unless the decoded bf16 bits (int16 view, any device) match the original's checksum."""
    if tensor_checksum(bits) != t.xxh3:
        raise CompressedFormatError(f"compressed tensor {t.name!r} decoded to values whose checksum differs from "
                                    f"the original's: the checkpoint is corrupt; compress it again")
