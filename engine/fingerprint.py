"""Which checkpoint a model is: engines exchange KV only when their fingerprints agree.

The fingerprint hashes config.json and the weight files' names and sizes. A checkpoint written by
`edgefire compress` from a bf16 checkpoint decodes to the same weights bit for bit, so it records
its source's weight files and takes the source's fingerprint: the original and the compressed copy
may serve one conversation between them. (A source converted to bf16 on the way records none.)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from engine.compression.checkpoint import is_compressed, read_manifest


def weight_identity(model_dir: Path) -> list[str]:
    """The weight files as `name:size`, or for a lossless compressed checkpoint its source's."""
    if is_compressed(model_dir):
        source = read_manifest(model_dir).source_weights
        if source is not None:
            return source
    return [f"{path.name}:{path.stat().st_size}" for path in sorted(model_dir.glob("*.safetensors"))]


def model_fingerprint(model_dir: Path) -> str:
    """Same config and weights => same fingerprint; KV moves only between engines that agree on it."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for entry in weight_identity(model_dir):
        digest.update(entry.encode())
    return digest.hexdigest()[:16]
