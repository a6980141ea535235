"""Which checkpoint a model is: engines exchange KV only when their fingerprints agree.

The fingerprint hashes config.json and, per weight file, its name, size, safetensors header and
samples of every tensor's bytes. Names and sizes alone are the same for every checkpoint of one
architecture (a fine-tune, another training run, a model re-initialised with another seed), and
KV from one of those decodes into wrong tokens on another. Hashing every byte would cost a read of
the whole checkpoint at each start; a few windows of each tensor catch any tensor that changed as
training changes one (nearly every element), at a few small reads per tensor.

A checkpoint written by `edgefire compress` from a bf16 checkpoint decodes to the same weights bit
for bit, so it records its source's weight identity and takes the source's fingerprint: the
original and the compressed copy may serve one conversation between them. (A source converted to
bf16 on the way records none.)
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from engine.compression.checkpoint import is_compressed, read_manifest

SAMPLE_BYTES = 1024      # one window of a tensor's bytes
SAMPLES_PER_TENSOR = 4   # windows spread evenly from the tensor's first byte to its last
_HEADER_SIZE = struct.Struct("<Q")


def weight_identity(model_dir: Path) -> list[str]:
    """The weight files as `name:size:content digest`, or for a lossless compressed checkpoint its source's."""
    if is_compressed(model_dir):
        source = read_manifest(model_dir).source_weights
        if source is not None:
            return source
    return [f"{path.name}:{path.stat().st_size}:{content_digest(path)}"
            for path in sorted(model_dir.glob("*.safetensors"))]


def content_digest(path: Path) -> str:
    """A digest of a safetensors file's header and of SAMPLES_PER_TENSOR windows of each tensor's data."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        prefix = f.read(_HEADER_SIZE.size)
        if len(prefix) < _HEADER_SIZE.size:
            return digest.hexdigest()[:16]  # not a safetensors file: the loader says so
        (header_size,) = _HEADER_SIZE.unpack(prefix)
        header = f.read(min(header_size, path.stat().st_size))
        digest.update(header)
        data_start = _HEADER_SIZE.size + len(header)
        for begin, end in _data_ranges(header):
            for offset in _windows(begin, end):
                f.seek(data_start + offset)
                digest.update(f.read(min(SAMPLE_BYTES, end - offset)))
    return digest.hexdigest()[:16]


def _data_ranges(header: bytes) -> list[tuple[int, int]]:
    """Each tensor's [begin, end) within the data section, in header order; [] when the header is not readable."""
    try:
        entries = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return []
    if not isinstance(entries, dict):
        return []
    ranges = []
    for name, entry in entries.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) and name != "__metadata__" else None
        if isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets):
            begin, end = offsets
            if 0 <= begin < end:
                ranges.append((begin, end))
    return ranges


def _windows(begin: int, end: int) -> list[int]:
    """Start offsets of the sampled windows of [begin, end): the whole range when it is small."""
    last = max(begin, end - SAMPLE_BYTES)
    if last == begin:
        return [begin]
    step = (last - begin) / (SAMPLES_PER_TENSOR - 1)
    return sorted({begin + round(step * i) for i in range(SAMPLES_PER_TENSOR)})


def model_fingerprint(model_dir: Path) -> str:
    """Same config and weights => same fingerprint; KV moves only between engines that agree on it."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for entry in weight_identity(model_dir):
        digest.update(entry.encode())
    return digest.hexdigest()[:16]
