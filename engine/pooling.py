"""Embeddings: how a checkpoint pools its final hidden states (after the model's final norm) into one vector.

A checkpoint saved for sentence-transformers says so in `modules.json`: a Transformer module, then a
Pooling module whose `config.json` sets one `pooling_mode_*` key (`lasttoken`, `mean_tokens` or
`cls_token`), and optionally a Normalize module (the vector is then L2-normalized). A checkpoint without
`modules.json` is pooled as the decoder embedding models are (Qwen3-Embedding, gte-Qwen2, e5-mistral):
the last token's hidden state, L2-normalized. Anything else (max pooling, Dense layers, `include_prompt:
false`) is refused at load with the file and key that asked for it: the engine would otherwise return
vectors the model's users would not recognise.

Mean and CLS pooling read hidden states of positions a prefix-cache hit would skip, so their sequences
compute every prompt token; last-token pooling uses cache hits as generation does (the last token is
always computed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import read_json
from engine.errors import CheckpointError

METHODS = ("last", "mean", "cls")
# sentence-transformers' Pooling config keys -> the engine's method; the other pooling_mode_* keys are refused
_MODE_KEYS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_PIPELINE_MODULES = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
                     "sentence_transformers.models.Normalize")


@dataclass(slots=True, frozen=True)
class Pooling:
    method: str = "last"
    normalize: bool = True
    source: str = "default (no modules.json): last token, L2-normalized"

    @property
    def every_row(self) -> bool:
        """Whether every prompt position's hidden state is read (no prefix-cache hits may skip one)."""
        return self.method != "last"

    def positions(self, start: int, end: int, num_tokens: int) -> range:
        """The positions among [start, end) (one step's chunk of a prompt of num_tokens) whose hidden states
        the pooling reads."""
        if self.method == "mean":
            return range(start, end)
        if self.method == "cls":
            return range(0, 1) if start == 0 else range(0)
        return range(num_tokens - 1, num_tokens) if end == num_tokens else range(0)


@dataclass(slots=True)
class PoolingState:
    """One sequence's pooling so far: the running sum (mean), or the one row kept (last, cls), in float32."""

    pooling: Pooling
    total: torch.Tensor | None = None
    num_rows: int = 0

    def add(self, start: int, rows: torch.Tensor | None) -> None:
        """The hidden states of one step's wanted positions (Pooling.positions; None: none) of the chunk
        starting at prompt position `start`. A chunk at position 0 restarts the pooling: a preempted
        sequence recomputes."""
        if start == 0:
            self.total, self.num_rows = None, 0
        if rows is None:
            return
        rows = rows.float()
        if self.pooling.method == "mean":
            summed = rows.sum(dim=0)
            self.total = summed if self.total is None else self.total + summed
            self.num_rows += len(rows)
        else:
            self.total, self.num_rows = rows[-1].clone(), 1

    def vector(self) -> torch.Tensor:
        """The pooled embedding (float32, on the CPU)."""
        if self.total is None:
            raise RuntimeError("pooling finished without the hidden states it reads")  # an engine invariant
        vector = self.total / self.num_rows if self.pooling.method == "mean" else self.total
        if self.pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.cpu()


def load_pooling(model_dir: str | Path, hidden_size: int) -> Pooling:
    """The checkpoint's pooling (see the module docstring); CheckpointError naming the file and key it
    cannot follow."""
    model_dir = Path(model_dir)
    path = model_dir / "modules.json"
    if not path.is_file():
        return Pooling()
    modules = read_json(path, kind=list, what="a JSON list of modules")
    pooling_dir, normalize = None, False
    for index, module in enumerate(modules):
        if not isinstance(module, dict) or not isinstance(module.get("type"), str):
            raise CheckpointError(f"{path}: entry {index} must be an object with a string 'type'")
        kind = module["type"]
        if kind not in _PIPELINE_MODULES:
            raise CheckpointError(f"{path}: entry {index} has type {kind!r}, which embeddings do not support (only "
                                  f"Transformer, Pooling and Normalize modules; a Dense or other module would change "
                                  f"the vectors)")
        if kind.endswith(".Pooling"):
            if pooling_dir is not None:
                raise CheckpointError(f"{path}: more than one Pooling module")
            if not isinstance(module.get("path"), str):
                raise CheckpointError(f"{path}: entry {index} (Pooling) must have a string 'path'")
            pooling_dir = model_dir / module["path"]
        elif kind.endswith(".Normalize"):
            normalize = True
    if pooling_dir is None:
        raise CheckpointError(f"{path} has no sentence_transformers.models.Pooling module; add one, or remove "
                              f"modules.json for last-token pooling")
    method = _read_pooling_config(pooling_dir / "config.json", hidden_size)
    return Pooling(method, normalize, f"{path}: {method} pooling{', L2-normalized' if normalize else ''}")


def _read_pooling_config(path: Path, hidden_size: int) -> str:
    config = read_json(path)
    chosen = [key for key, value in config.items() if key.startswith("pooling_mode") and value is True]
    unsupported = [key for key in chosen if key not in _MODE_KEYS]
    if unsupported:
        raise CheckpointError(f"{path}: {unsupported[0]} is not supported; embeddings pool by "
                              f"{', '.join(_MODE_KEYS)}")
    if len(chosen) != 1:
        raise CheckpointError(f"{path}: set exactly one of {', '.join(_MODE_KEYS)} to true (found "
                              f"{', '.join(chosen) or 'none'})")
    if config.get("include_prompt", True) is not True:
        raise CheckpointError(f"{path}: include_prompt false is not supported (every input token is pooled)")
    dimension = config.get("word_embedding_dimension", hidden_size)
    if dimension != hidden_size:
        raise CheckpointError(f"{path}: word_embedding_dimension {dimension!r} is not the model's hidden_size "
                              f"{hidden_size}")
    return _MODE_KEYS[chosen[0]]
