"""Checkpoint loading: safetensors (single file or sharded with an index) straight to device and dtype.

Files are memory-mapped by safetensors; each tensor is read once, cast, and fused into the
engine's layout (q/k/v and gate/up concatenated). A progress bar shows the tensors loaded.

A checkpoint written by `edgefire compress` (engine/compression) loads the same way: its tensors are
decoded and checked as they are read (weight mode `decompress_on_load`), or, in
`compressed_in_memory`, the MLP projections stay compressed on the device and the model's layers
become an `engine.compression.streamed.StreamedLayers` that decodes them layer by layer. An MXFP4
checkpoint's quantized experts are copied into its compressed copy as they are, and read from either alike.

Under tensor/pipeline/expert parallelism each rank reads only its part
(engine.parallel.layout.RankShard): its stage's layers, of each tensor only its rows or columns,
and of each mixture-of-experts layer only its experts, sliced in the file, never read whole and
cut afterwards. A compressed tensor is entropy-coded as a whole, so a TP rank decodes it
and keeps its slice; compressed_in_memory keeps whole MLP weights and is for whole layers only.

An image-and-text checkpoint (Gemma 3's, Mistral 3's, Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's, Qwen3-VL-MoE's, Llama 4's)
loads as its text model: its text tensors are read under the names a text-only checkpoint gives them
(text_model_names), and its image encoder is left unread.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from engine import mxfp4
from engine.compression import WEIGHT_MODES
from engine.compression.checkpoint import CompressedCheckpoint, open_checkpoint
from engine.compression.decode import needs_pair_tables, uses_kernel
from engine.compression.streamed import CompressedMLP, StreamedLayers
from engine.compression.tables import pair_table
from engine.config import HUNYUAN_MODEL_TYPES, ModelConfig, load_config
from engine.errors import CheckpointError
from engine.mla import MLAWeights, split_kv_b
from engine.model import CausalLM, LayerWeights, ModelWeights
from engine.moe import MoEWeights
from engine.parallel.layout import RankShard, whole_model

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Stored dtypes a weight may have: integer and float8 tensors are quantized and mean nothing without
# their scales, which this engine does not apply
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """`auto` means bfloat16 on GPU and float32 on CPU (CPU matmuls in bf16 are slow and inexact)."""
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the file that holds it."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({exc})") from exc
        if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
            raise CheckpointError(f"{index_path}: weight_map must map each tensor name to a file name")
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"{index_path} names shard {shard.name}, which is missing")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{model_dir}: no *.safetensors weight files")
    files = {}
    for shard in shards:
        for name in _open(shard).keys():
            if name in files:   # which copy would win is an accident of file names
                raise CheckpointError(f"{model_dir}: tensor {name!r} is in both {files[name].name} and {shard.name}; "
                                      f"remove the stray file or add a model.safetensors.index.json")
            files[name] = shard
    return files


def has_lm_head(model_dir: str | Path, cfg: ModelConfig) -> bool:
    """Whether the model can generate: it stores an LM head or ties it to its embeddings (a bare backbone
    saved for embeddings may have neither)."""
    return cfg.tie_word_embeddings or stores_lm_head(model_dir)


def stores_lm_head(model_dir: str | Path) -> bool:
    """Whether the checkpoint has an lm_head.weight tensor (read from the index or the files' headers, not the
    weights): the memory check counts it for a tied model too, since _read_lm_head reads it."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    compressed = open_checkpoint(model_dir, files)
    return "lm_head.weight" in text_model_names(compressed.names() if compressed else files, load_config(model_dir))


# Image-and-text checkpoints nest the text model: Gemma 3's, Mistral 3's and Llama 4's older saves as
# language_model.model.* and language_model.lm_head, newer ones (every family's) as model.language_model.* and
# lm_head; Qwen2-VL's and Qwen2.5-VL's older saves name it as a text-only checkpoint does (model.*, lm_head). Beside
# it lies the image encoder with its projector (Gemma 3, Mistral 3: vision_tower.*, multi_modal_projector.*; Qwen:
# visual.*, under model. in newer saves; Llama 4: vision_model.*, multi_modal_projector.*), which the engine does
# not serve
TEXT_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                       ("model.language_model.", "model."))
IMAGE_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                  "visual.", "model.visual.", "vision_model.")
# Tensors a model type's checkpoints store that transformers does not load, nor does the engine: ERNIE 4.5's
# multi-token-prediction block (model.mtp_block.0.*, mtp_emb_norm, mtp_hidden_norm, mtp_linear_proj), K-EXAONE's
# (mtp.*)
UNREAD_PREFIXES = {"ernie4_5_moe": ("model.mtp_",), "exaone_moe": ("mtp.", "model.mtp.")}


def is_bare_backbone(names) -> bool:
    """A checkpoint saved as the bare decoder (`Qwen3Model`, `LlamaModel`: how embedding models are saved):
    its tensors are named without the `model.` prefix (`embed_tokens.weight`, `layers.0...`) and it has no
    LM head unless its embeddings are tied. Such a model serves embeddings (engine.pooling)."""
    names = set(names)
    return "embed_tokens.weight" in names and "model.embed_tokens.weight" not in names


def text_model_names(names, cfg: ModelConfig) -> dict[str, str]:
    """The engine's name of each tensor it may read -> the checkpoint's name of it: the same name, but for an
    image-and-text checkpoint the text model's tensors renamed (`language_model.model.norm.weight` is
    `model.norm.weight`) and the image encoder's left out, and for a bare backbone (is_bare_backbone)
    `model.` put before every name."""
    if is_bare_backbone(names):
        return {f"model.{name}": name for name in names}
    if not cfg.image_text_checkpoint:
        unread = UNREAD_PREFIXES.get(cfg.model_type, ())
        return {name: name for name in names if not name.startswith(unread)}
    renamed: dict[str, str] = {}
    for name in names:
        if name.startswith(IMAGE_PREFIXES):
            continue
        engine_name = next((ours + name[len(theirs):] for theirs, ours in TEXT_MODEL_PREFIXES
                            if name.startswith(theirs)), name)
        if engine_name in renamed:
            raise CheckpointError(f"checkpoint stores {engine_name!r} twice, as {renamed[engine_name]!r} and {name!r}")
        renamed[engine_name] = name
    return renamed


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from exc


class _TensorReader:
    """Reads named tensors from their shards, checking shapes, with one open handle per shard."""

    def __init__(self, files: dict[str, Path], device: torch.device, dtype: torch.dtype, progress: tqdm,
                 compressed: CompressedCheckpoint | None = None, stored: dict[str, str] | None = None):
        self.files = files
        # the engine's tensor names -> the checkpoint's (text_model_names); reads and errors speak of the former
        self.stored = stored if stored is not None else {name: name for name in (compressed.names() if compressed
                                                                                  else files)}
        self.device = device
        self.dtype = dtype
        self.progress = progress
        self.handles: dict[Path, object] = {}
        self.compressed = compressed
        self.pair_tables: dict[bytes, torch.Tensor] = {}   # one 256 KiB table per distinct code, shared
        self.names_read: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.stored

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored tensor's shape, read from the file's header (a compressed tensor's from its record)."""
        if not self.has(name):
            raise CheckpointError(f"checkpoint is missing tensor {self.stored_name(name)!r}")
        name = self.stored[name]
        if self.compressed is not None:
            stored = self.compressed.read_compressed(name) if self.compressed.is_compressed(name) \
                else self.compressed.read_plain(name)
            return tuple(stored.shape)
        path = self.files[name]
        handle = self.handles.get(path) or self.handles.setdefault(path, _open(path))
        try:
            return tuple(handle.get_slice(name).get_shape())
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({exc})") from exc

    def stored_name(self, name: str) -> str:
        """The checkpoint's name of a tensor, also of one it lacks: spelled as its other text tensors are."""
        if name in self.stored:
            return self.stored[name]
        renamed = ((theirs, ours) for theirs, ours in TEXT_MODEL_PREFIXES if ours == "model." and name.startswith(ours)
                   and any(stored.startswith(theirs) for stored in self.stored.values()))
        return next((theirs + name[len(ours):] for theirs, ours in renamed), name)

    def read(self, name: str, shape: tuple[int, ...], rows: range | list[range] | None = None,
             cols: range | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor, or only its `rows` (first dimension; a list: those row ranges, concatenated, as a
        rank takes its part of each projection of a fused one) / `cols` (second), in `dtype` (default: the
        model's)."""
        if not self.has(name):
            raise CheckpointError(f"checkpoint is missing tensor {self.stored_name(name)!r}")
        parts = _joined(rows if isinstance(rows, list) else [rows], shape[0]) if shape else [None]   # () a scalar
        cols = None if cols is None or len(cols) == shape[1] else cols
        if self.compressed is not None:
            tensor = self.compressed.read(self.stored[name], self.device)
            _check_shape(name, tuple(tensor.shape), shape)
            pieces = [_part(tensor, part, cols) for part in parts]
        else:
            pieces = self._read_plain(name, shape, parts, cols)
        tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if tensor.dtype not in WEIGHT_DTYPES:
            raise CheckpointError(f"tensor {name!r} is stored as {str(tensor.dtype).removeprefix('torch.')}; the "
                                  f"engine loads float32, float16 or bfloat16 weights (quantized checkpoints are "
                                  f"not supported)")
        self.names_read.add(name)
        self.progress.update(1)
        return tensor.to(device=self.device, dtype=dtype or self.dtype)

    def read_as_stored(self, name: str, shape: tuple[int, ...], rows: range | None = None) -> torch.Tensor:
        """The tensor (or only its `rows`, of the first dimension) as the checkpoint stores it, dtype included, on
        the CPU: quantized data (engine.mxfp4) that the caller expands. A compressed checkpoint holds such
        tensors as plain entries, read whole and checked against their checksum, as any plain tensor there."""
        if not self.has(name):
            raise CheckpointError(f"checkpoint is missing tensor {self.stored_name(name)!r}")
        parts = _joined([rows], shape[0])
        if self.compressed is not None:
            tensor = self.compressed.read(self.stored[name])
            _check_shape(name, tuple(tensor.shape), shape)
            tensor = _part(tensor, parts[0], None)
        else:
            tensor = self._read_plain(name, shape, parts, None)[0]
        self.names_read.add(name)
        self.progress.update(1)
        return tensor

    def _read_plain(self, name: str, shape: tuple[int, ...], parts: list[range | None],
                    cols: range | None) -> list[torch.Tensor]:
        name = self.stored[name]
        path = self.files[name]
        handle = self.handles.get(path) or self.handles.setdefault(path, _open(path))
        try:
            part = handle.get_slice(name)
            _check_shape(name, tuple(part.get_shape()), shape)
            if parts == [None] and cols is None:
                return [handle.get_tensor(name)]
            if cols is None:
                return [part[rows.start:rows.stop] for rows in parts]  # only these rows are read from the file
            return [part[:, cols.start:cols.stop]]
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({exc})") from exc

    def read_compressed_mlp(self, prefix: str, shapes: dict[str, tuple[int, ...]],
                            stems: dict[str, str] | None = None) -> CompressedMLP | None:
        """The layer's MLP projections (under `prefix`, the MLP block's) still compressed, on the device (each
        decoded once here and checked), or None unless all of them are compressed. `shapes` names the projections
        as the checkpoint stores them: gate, up and down, or gate_up and down (fused); `stems` the stored names where
        they are not {proj}_proj. (an ungated MLP's: UNGATED_MLP_NAMES)."""
        stems = stems or {}
        names = {proj: f"{prefix}{stems.get(proj, proj + '_proj.')}weight" for proj in shapes}
        if self.compressed is None or not all(self.compressed.is_compressed(self.stored.get(n, n))
                                              for n in names.values()):
            return None
        tensors = {}
        for proj, name in names.items():
            tensor = self.compressed.read_compressed(self.stored[name])
            _check_shape(name, tensor.shape, shapes[proj])
            tensors[proj] = tensor.to(self.device)
            self.compressed.check_decodes(tensors[proj], self.device)   # decoded once, checked, dropped
            self.names_read.add(name)
            self.progress.update(1)
        gate_up = tuple(tensors[proj] for proj in shapes if proj != "down")
        mlp = CompressedMLP(gate_up, tensors["down"], None)
        if needs_pair_tables(self.device):
            mlp.tables = tuple(self._pair_table(t) for t in mlp.parts)
        return mlp

    def _pair_table(self, t) -> torch.Tensor:
        key = t.palette.cpu().numpy().tobytes() + t.code_lengths.cpu().numpy().tobytes()
        if key not in self.pair_tables:
            self.pair_tables[key] = pair_table(t.palette, t.code_lengths).to(self.device)
        return self.pair_tables[key]


def _joined(parts: list[range | None], num_rows: int) -> list[range | None]:
    """Row ranges with adjacent ones merged; [None] when they cover every row in order (read whole)."""
    merged: list[range] = []
    for rows in parts:
        if rows is None:
            return [None]
        if merged and merged[-1].stop == rows.start:
            merged[-1] = range(merged[-1].start, rows.stop)
        else:
            merged.append(rows)
    return [None] if merged == [range(num_rows)] else merged


def _shifted(rows: range, offset: int) -> range:
    return range(rows.start + offset, rows.stop + offset)


def _part(tensor: torch.Tensor, rows: range | None, cols: range | None) -> torch.Tensor:
    if rows is not None:
        return tensor[rows.start:rows.stop].clone()  # not a view: the whole decoded tensor is freed
    if cols is not None:
        return tensor[:, cols.start:cols.stop].clone()
    return tensor


def _check_shape(name: str, actual: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if actual != expected:
        raise CheckpointError(f"tensor {name!r} has shape {actual}, config implies {expected}")


def _read_mla(reader: _TensorReader, cfg: ModelConfig, p: str, heads: range) -> MLAWeights:
    """Latent attention for the query heads `heads` (under TP a rank's share; the latent projections whole)."""
    mla, hidden, num_heads = cfg.mla, cfg.hidden_size, cfg.num_heads
    rank, kv_b_dim = mla.kv_lora_rank, mla.qk_nope_head_dim + mla.v_head_dim

    def rows_of(per_head: int) -> range:
        return range(heads.start * per_head, heads.stop * per_head)

    q_rows, q_part = num_heads * mla.qk_head_dim, rows_of(mla.qk_head_dim)
    a = p + "self_attn."
    q_proj = q_a_proj = q_a_norm = q_b_proj = None
    if mla.q_lora_rank is None:
        q_proj = reader.read(a + "q_proj.weight", (q_rows, hidden), rows=q_part)
    else:
        q_a_proj = reader.read(a + "q_a_proj.weight", (mla.q_lora_rank, hidden))
        q_a_norm = reader.read(a + "q_a_layernorm.weight", (mla.q_lora_rank,))
        q_b_proj = reader.read(a + "q_b_proj.weight", (q_rows, mla.q_lora_rank), rows=q_part)
    kv_b = reader.read(a + "kv_b_proj.weight", (num_heads * kv_b_dim, rank), rows=rows_of(kv_b_dim))
    k_up, v_up = split_kv_b(kv_b, mla)
    return MLAWeights(
        q_proj=q_proj, q_a_proj=q_a_proj, q_a_norm=q_a_norm, q_b_proj=q_b_proj,
        kv_a_proj=reader.read(a + "kv_a_proj_with_mqa.weight", (rank + mla.qk_rope_head_dim, hidden)),
        kv_a_norm=reader.read(a + "kv_a_layernorm.weight", (rank,)),
        k_up=k_up, v_up=v_up,
        o_proj=reader.read(a + "o_proj.weight", (hidden, num_heads * mla.v_head_dim), cols=rows_of(mla.v_head_dim)),
    )


def _read_norm(reader: _TensorReader, cfg: ModelConfig, name: str, size: int,
               rows: range | None = None) -> torch.Tensor:
    """A norm's weight (or its `rows`: a TP rank's heads' part of OLMo 2's q/k norms); Gemma 3's (which scales by
    1 + weight) as 1 + weight in float32, computed as transformers computes it, so that engine.ops.rms_norm
    multiplies in float32 and rounds after, as transformers does. nanochat's norms store no weight: float32 ones, read
    from nothing (the float32 row times 1, rounded after, is transformers' weightless norm)."""
    if not cfg.norm_weights:
        return torch.ones(size if rows is None else len(rows), dtype=torch.float32, device=reader.device)
    if cfg.norms_in_float32:   # gpt-oss, OLMo 2: the weight itself, in float32 (transformers multiplies these so)
        return reader.read(name, (size,), rows=rows, dtype=torch.float32)
    if not cfg.norm_weight_offset:
        return reader.read(name, (size,), rows=rows)
    if cfg.norm_bias:   # Nemotron's LayerNorm1P: 1 + weight in the model's dtype, rounded as transformers rounds it
        return reader.read(name, (size,), rows=rows) + 1.0
    return reader.read(name, (size,), rows=rows, dtype=torch.float32) + 1.0


def _read_layer(reader: _TensorReader, cfg: ModelConfig, i: int, shard: RankShard,
                keep_mlp_compressed: bool = False) -> tuple[LayerWeights, CompressedMLP | None]:
    p = f"model.layers.{i}."
    if cfg.mla is not None:
        layer = LayerWeights(input_norm=reader.read(p + "input_layernorm.weight", (cfg.hidden_size,)), qkv=None,
                             qkv_bias=None, q_norm=None, k_norm=None, o_proj=None,
                             post_norm=reader.read(p + "post_attention_layernorm.weight", (cfg.hidden_size,)),
                             gate_up=None, down=None, mla=_read_mla(reader, cfg, p, shard.heads))
        return _read_mlp(reader, cfg, i, shard, layer, keep_mlp_compressed)
    hidden, head_dim = cfg.hidden_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_heads * head_dim, cfg.num_kv_heads * head_dim
    q_part = range(shard.heads.start * head_dim, shard.heads.stop * head_dim)
    kv_part = range(shard.kv_heads.start * head_dim, shard.kv_heads.stop * head_dim)
    if cfg.fused_projections:   # Phi-3's qkv_proj: q, k, v rows one after the other; this rank's of each
        qkv = reader.read(p + "self_attn.qkv_proj.weight", (q_rows + 2 * kv_rows, hidden),
                          rows=[q_part, _shifted(kv_part, q_rows), _shifted(kv_part, q_rows + kv_rows)])
    else:
        qkv = torch.cat([
            reader.read(p + "self_attn.q_proj.weight", (q_rows, hidden), rows=q_part),
            reader.read(p + "self_attn.k_proj.weight", (kv_rows, hidden), rows=kv_part),
            reader.read(p + "self_attn.v_proj.weight", (kv_rows, hidden), rows=kv_part),
        ])
    qkv_bias = None
    if cfg.qkv_bias:
        qkv_bias = torch.cat([
            reader.read(p + "self_attn.q_proj.bias", (q_rows,), rows=q_part),
            reader.read(p + "self_attn.k_proj.bias", (kv_rows,), rows=kv_part),
            reader.read(p + "self_attn.v_proj.bias", (kv_rows,), rows=kv_part),
        ])
    if cfg.attn_output_gate:   # Trinity's gate_proj (unbiased): this rank's heads' rows, after v's
        qkv = torch.cat([qkv, reader.read(p + "self_attn.gate_proj.weight", (q_rows, hidden), rows=q_part)])
        if qkv_bias is not None:
            qkv_bias = torch.cat([qkv_bias, qkv_bias.new_zeros(len(q_part))])
    if cfg.rope_interleaved:   # q's and k's rows, whole heads of this rank's, in the order the engine rotates
        qkv[:len(q_part) + len(kv_part)] = _rotary_rows(qkv[:len(q_part) + len(kv_part)], cfg)
        if qkv_bias is not None:
            qkv_bias[:len(q_part) + len(kv_part)] = _rotary_rows(qkv_bias[:len(q_part) + len(kv_part)], cfg)
    q_norm = k_norm = None
    if cfg.qk_norm and cfg.qk_norm_over_heads:   # OLMo 2: over the whole projections, of which this rank's heads'
        q_norm = _read_norm(reader, cfg, p + "self_attn.q_norm.weight", q_rows, rows=q_part)
        k_norm = _read_norm(reader, cfg, p + "self_attn.k_norm.weight", kv_rows, rows=kv_part)
    elif cfg.qk_norm and cfg.qk_norm_weight_per_head:   # Command R+: a row of weights per head, of this rank's heads
        q_norm = _read_head_norms(reader, cfg, p + "self_attn.q_norm.weight", cfg.num_heads, shard.heads)
        k_norm = _read_head_norms(reader, cfg, p + "self_attn.k_norm.weight", cfg.num_kv_heads, shard.kv_heads)
    elif cfg.qk_norm:   # Hunyuan's are named query_layernorm and key_layernorm
        q_name, k_name = ("query_layernorm", "key_layernorm") if cfg.model_type in HUNYUAN_MODEL_TYPES else \
            ("q_norm", "k_norm")
        q_norm = _read_norm(reader, cfg, f"{p}self_attn.{q_name}.weight", head_dim)
        k_norm = _read_norm(reader, cfg, f"{p}self_attn.{k_name}.weight", head_dim)
    input_name, post_name = LAYER_NORM_NAMES.get(cfg.model_type, ("input_layernorm.", "post_attention_layernorm."))
    layer = LayerWeights(
        input_norm=_read_norm(reader, cfg, p + input_name + "weight", hidden) if cfg.input_norms else None,
        input_norm_bias=reader.read(p + input_name + "bias", (hidden,)) if cfg.norm_bias else None,
        post_norm_bias=reader.read(p + post_name + "bias", (hidden,)) if cfg.norm_bias else None,
        qkv=qkv,
        qkv_bias=qkv_bias,
        q_norm=q_norm,
        k_norm=k_norm,
        o_proj=reader.read(p + "self_attn.o_proj.weight", (hidden, q_rows), cols=q_part),
        post_norm=None if cfg.parallel_block else _read_norm(reader, cfg, p + post_name + "weight", hidden),
        gate_up=None,
        down=None,
        o_bias=reader.read(p + "self_attn.o_proj.bias", (hidden,)) if cfg.o_bias else None,
    )
    if cfg.attention_sinks:   # gpt-oss: this rank's heads' sinks
        layer.sinks = reader.read(p + "self_attn.sinks", (cfg.num_heads,), rows=shard.heads, dtype=torch.float32)
    if cfg.sandwich_norms and cfg.model_type == "glm4":   # GLM-4: post_attention_layernorm norms the MLP's input
        layer.attn_out_norm = _read_norm(reader, cfg, p + "post_self_attn_layernorm.weight", hidden)
        layer.mlp_out_norm = _read_norm(reader, cfg, p + "post_mlp_layernorm.weight", hidden)
    elif cfg.sandwich_norms:   # Gemma 3: post_attention_layernorm norms the attention's output; the MLP's input
        layer.attn_out_norm = layer.post_norm   # is pre_feedforward_layernorm's, its output post_feedforward's
        layer.post_norm = None   # OLMo 2 (no input norms): the MLP takes the residual stream unnormed
        pre_mlp, post_mlp = MLP_NORM_NAMES.get(cfg.model_type, ("pre_feedforward_layernorm.",
                                                                "post_feedforward_layernorm."))
        if cfg.input_norms:
            layer.post_norm = _read_norm(reader, cfg, p + pre_mlp + "weight", hidden)
        layer.mlp_out_norm = _read_norm(reader, cfg, p + post_mlp + "weight", hidden)
    return _read_mlp(reader, cfg, i, shard, layer, keep_mlp_compressed)


# A layer's two norms' names where they are not input_layernorm and post_attention_layernorm (Apertus's)
LAYER_NORM_NAMES = {"apertus": ("attention_layernorm.", "feedforward_layernorm.")}
# Four norms a layer: the MLP's input's and output's names where they are not Gemma 3's (Trinity's)
MLP_NORM_NAMES = {"afmoe": ("pre_mlp_layernorm.", "post_mlp_layernorm.")}


def _read_head_norms(reader: _TensorReader, cfg: ModelConfig, name: str, num_heads: int, heads: range) -> torch.Tensor:
    """Command R+'s q or k norm weights [num_heads, head_dim], the rows of `heads`, in float32 (transformers multiplies
    the float32 row by them), each head's dims in the order its q or k rows were put in (_rotary_halves)."""
    weights = reader.read(name, (num_heads, cfg.head_dim), rows=heads, dtype=torch.float32)
    return _rotary_halves(weights.reshape(-1), cfg.head_dim).view(weights.shape) if cfg.rope_interleaved else weights


def _rotary_halves(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A projection's rows (weight or bias) of whole heads, each head's rotary dims stored as interleaved pairs
    (x0, x1), (x2, x3), ..., reordered to x0, x2, ... then x1, x3, ...: rotating the halves (engine.ops.apply_rotary)
    then rotates each pair by its frequency exactly as the interleaved rotary does. Queries and keys are permuted
    alike, so their dot products, the attention's scores, do not change."""
    heads = rows.reshape(-1, head_dim // 2, 2, *rows.shape[1:])
    return heads.transpose(1, 2).reshape(rows.shape)


def _rotary_rows(rows: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """q's and k's rows of whole heads in the order the engine rotates (_rotary_halves); under partial rotary (GLM-4)
    each head's first rotary_dim dims reordered, the others kept as stored."""
    if cfg.rotary_dim is None:
        return _rotary_halves(rows, cfg.head_dim)
    rotary_dim, shape = cfg.rotary_dim, rows.shape[1:]
    heads = rows.reshape(-1, cfg.head_dim, *shape)
    rotary = _rotary_halves(heads[:, :rotary_dim].reshape(-1, *shape), rotary_dim).reshape(-1, rotary_dim, *shape)
    return torch.cat([rotary, heads[:, rotary_dim:]], dim=1).reshape(rows.shape)


def _read_mlp(reader: _TensorReader, cfg: ModelConfig, i: int, shard: RankShard, layer: LayerWeights,
              keep_mlp_compressed: bool) -> tuple[LayerWeights, CompressedMLP | None]:
    p, hidden = f"model.layers.{i}.{MLP_PREFIXES.get(cfg.model_type, 'mlp.')}", cfg.hidden_size
    mlp = None
    if cfg.is_sparse(i):
        layer.moe = _read_moe(reader, cfg, i, shard.experts)
    elif not cfg.gated_mlp:   # StarCoder2: c_fc's rows (this rank's) activated into c_proj (the others: up, down)
        inter = cfg.intermediate_size
        up_name, down_name = UNGATED_MLP_NAMES.get(cfg.model_type, ("up_proj.", "down_proj."))
        # Kept compressed, StreamedLayers points gate_up and down at its decode buffers.
        if keep_mlp_compressed:
            mlp = reader.read_compressed_mlp(p, {"up": (inter, hidden), "down": (hidden, inter)},
                                             {"up": up_name, "down": down_name})
        if mlp is None:
            layer.gate_up = reader.read(p + up_name + "weight", (inter, hidden), rows=shard.mlp)
            layer.down = reader.read(p + down_name + "weight", (hidden, inter), cols=shard.mlp)
        if cfg.mlp_bias:
            layer.gate_up_bias = reader.read(p + up_name + "bias", (inter,), rows=shard.mlp)
            layer.down_bias = reader.read(p + down_name + "bias", (hidden,))
        if cfg.hidden_act == "xielu":
            layer.act_params = _read_xielu(reader, p + "act_fn.")
    else:
        inter = cfg.intermediate_size
        shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        fused = cfg.fused_projections or cfg.fused_gate_up
        stored = {"gate_up": (2 * inter, hidden), "down": shapes["down"]} if fused else shapes
        # Kept compressed, StreamedLayers points gate_up and down at its decode buffers.
        mlp = reader.read_compressed_mlp(p, stored) if keep_mlp_compressed else None
        if mlp is None and fused:   # Phi-3's and GLM-4's gate_up_proj: gate rows, then up rows; this rank's of each
            layer.gate_up = reader.read(p + "gate_up_proj.weight", (2 * inter, hidden),
                                        rows=[shard.mlp, _shifted(shard.mlp, inter)])
            layer.down = reader.read(p + "down_proj.weight", shapes["down"], cols=shard.mlp)
        elif mlp is None:
            layer.gate_up = torch.cat([
                reader.read(p + "gate_proj.weight", shapes["gate"], rows=shard.mlp),
                reader.read(p + "up_proj.weight", shapes["up"], rows=shard.mlp),
            ])
            layer.down = reader.read(p + "down_proj.weight", shapes["down"], cols=shard.mlp)
        if cfg.mlp_bias:
            layer.gate_up_bias = torch.cat([reader.read(p + "gate_proj.bias", (inter,), rows=shard.mlp),
                                            reader.read(p + "up_proj.bias", (inter,), rows=shard.mlp)])
            layer.down_bias = reader.read(p + "down_proj.bias", (hidden,))
    return layer, mlp


# A layer's MLP block's name where it is not `mlp.` (Llama 4's, dense or mixture of experts)
MLP_PREFIXES = {"llama4_text": "feed_forward."}
# An ungated MLP's projections' names where they are not up_proj and down_proj (StarCoder2's, nanochat's)
UNGATED_MLP_NAMES = {"starcoder2": ("c_fc.", "c_proj."), "nanochat": ("fc1.", "fc2.")}


def _read_xielu(reader: _TensorReader, p: str) -> torch.Tensor:
    """Apertus's xIELU parameters of one layer (under p, the activation's prefix) as engine.ops.xielu takes them, in the
    model's dtype: softplus(alpha_p), beta + softplus(alpha_n), beta, eps, each computed in that dtype as transformers
    computes them (alpha_p and alpha_n stored [1], beta and eps as scalars; a checkpoint lacking beta or eps leaves
    transformers' uninitialized, so they are required here)."""
    alpha_p, alpha_n = (reader.read(p + name, (1,))[0] for name in ("alpha_p", "alpha_n"))
    beta, eps = (reader.read(p + name, ()) for name in ("beta", "eps"))
    softplus = torch.nn.functional.softplus
    return torch.stack([softplus(alpha_p), beta + softplus(alpha_n), beta, eps])


# Tensors some checkpoints store that a model recomputes rather than loads (older transformers saved rope's).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _wanted(name: str, shard: RankShard) -> bool:
    """Whether this rank reads the named tensor (for the progress bar's total)."""
    layer = _layer_of(name)
    if layer is not None:
        expert = _expert_of(name)
        return layer in shard.layers and (expert is None or expert in shard.experts)
    if name == "model.embed_tokens.weight":
        return shard.is_first_stage
    if name == "lm_head.weight":
        return shard.computes_logits
    return shard.is_last_stage


def _layer_of(name: str) -> int | None:
    """The decoder layer a tensor belongs to (`model.layers.{i}....`); None for any other tensor."""
    parts = name.split(".", 3)
    return int(parts[2]) if name.startswith("model.layers.") and len(parts) > 3 and parts[2].isdigit() else None


def _expert_of(name: str) -> int | None:
    """The expert a per-expert tensor belongs to (`...experts.{e}.w1.weight`); None for any other tensor."""
    _, found, rest = name.partition(".experts.")
    head = rest.split(".", 1)[0]
    return int(head) if found and head.isdigit() else None


# Per model type: the MoE block's prefix in a layer and its experts' (gate, up, down) tensor names.
MOE_NAMES = {"mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")),
             "minimax_m2": ("block_sparse_moe.", ("w1", "w3", "w2")),
             "qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
             "deepseek_v3": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
             "deepseek_v2": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
             "glm4_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
             "llama4_text": ("feed_forward.", ("gate_proj", "up_proj", "down_proj")),
             "ernie4_5_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
             "glm4_moe_lite": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
             "mistral4": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
             "hunyuan_v1_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
             "qwen2_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
             "olmoe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
             "flex_olmo": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
             "granitemoe": ("block_sparse_moe.", ()), "granitemoeshared": ("block_sparse_moe.", ()),
             **dict.fromkeys(("dots1", "exaone_moe", "solar_open", "afmoe"),
                             ("mlp.", ("gate_proj", "up_proj", "down_proj")))}
# ... and its router's and shared experts' names where they are not `gate.` and `shared_experts.`
MOE_ROUTER_SHARED_NAMES = {"llama4_text": ("router.", "shared_expert."), "hunyuan_v1_moe": ("gate.wg.", "shared_mlp."),
                           "qwen2_moe": ("gate.", "shared_expert."), "afmoe": ("router.gate.", "shared_experts."),
                           **dict.fromkeys(("granitemoe", "granitemoeshared"), ("router.layer.", "shared_mlp."))}
# Model types whose experts are only ever stored stacked, under these names (gate_up, down) in the block: Granite MoE's
# input_linear [E, 2 * inter, hidden] (each expert's gate rows, then its up rows) and output_linear [E, hidden, inter]
STACKED_EXPERT_NAMES = dict.fromkeys(("granitemoe", "granitemoeshared"),
                                     ("input_linear.weight", "output_linear.weight"))
# Stacked experts always stored transposed ([E, hidden, 2 * inter], [E, inter, hidden]), as transformers keeps them
TRANSPOSED_EXPERT_TYPES = ("llama4_text",)


def _read_moe(reader: _TensorReader, cfg: ModelConfig, i: int, experts: range) -> MoEWeights:
    """The router (whole: every rank routes its tokens over all experts) and this rank's `experts`,
    stacked into [len(experts), 2 * inter, hidden] and [len(experts), hidden, inter].

    Checkpoints store one tensor per expert projection (`experts.{e}.gate_proj.weight`); some tools
    write them already stacked (`experts.gate_up_proj`, `experts.down_proj`: _read_stacked_experts), whose
    rows of `experts` are read. Each expert is copied into a preallocated stack so loading never holds two
    copies of a layer.
    """
    moe = cfg.moe
    if cfg.model_type == "gpt_oss":
        return _read_gpt_oss_moe(reader, cfg, i, experts)
    prefix, names = MOE_NAMES[cfg.model_type]
    p = f"model.layers.{i}.{prefix}"
    hidden, inter, num_experts = cfg.hidden_size, moe.intermediate_size, moe.num_experts
    router_name, shared_name = MOE_ROUTER_SHARED_NAMES.get(cfg.model_type, ("gate.", "shared_experts."))
    # grouped routing (DeepSeek-V2 and V3, GLM-4.5) scores in float32 by a float32 router, as transformers keeps it
    # (MiniMax-M2's router: in the model's dtype)
    router = reader.read(p + router_name + "weight", (num_experts, hidden),
                         dtype=torch.float32 if moe.grouped and not moe.router_in_model_dtype else None)
    if cfg.model_type in STACKED_EXPERT_NAMES:
        gate_up, down = _read_stacked_experts(reader, cfg, p, experts, STACKED_EXPERT_NAMES[cfg.model_type])
    elif reader.has(p + "experts.gate_up_proj"):
        gate_up, down = _read_stacked_experts(reader, cfg, p + "experts.", experts)
    else:
        gate_name, up_name, down_name = names
        gate_up = torch.empty((len(experts), 2 * inter, hidden), dtype=reader.dtype, device=reader.device)
        down = torch.empty((len(experts), hidden, inter), dtype=reader.dtype, device=reader.device)
        for local, expert in enumerate(experts):
            e = f"{p}experts.{expert}."
            gate_up[local, :inter] = reader.read(f"{e}{gate_name}.weight", (inter, hidden))
            gate_up[local, inter:] = reader.read(f"{e}{up_name}.weight", (inter, hidden))
            down[local] = reader.read(f"{e}{down_name}.weight", (hidden, inter))
    weights = MoEWeights(router, gate_up, down, moe.num_experts_per_tok, moe.norm_topk_prob,
                         weighs_input=moe.scoring == "sigmoid_topk")
    if moe.grouped:
        weights.grouped_routing = moe
    if moe.has_correction_bias:
        # kept in float32, as the reference keeps it: it only ranks experts, and rounded to bfloat16
        # it would rank near ties differently
        weights.correction_bias = _read_correction_bias(reader, cfg, p)
    if moe.num_shared_experts and cfg.model_type == "granitemoeshared":   # gate and up fused, beside the block
        shared, s = moe.shared_width, f"model.layers.{i}.{shared_name}"
        weights.shared_gate_up = reader.read(s + "input_linear.weight", (2 * shared, hidden))
        weights.shared_down = reader.read(s + "output_linear.weight", (hidden, shared))
    elif moe.num_shared_experts:
        shared, s = moe.shared_width, p + shared_name
        weights.shared_gate_up = torch.cat([reader.read(s + "gate_proj.weight", (shared, hidden)),
                                            reader.read(s + "up_proj.weight", (shared, hidden))])
        weights.shared_down = reader.read(s + "down_proj.weight", (hidden, shared))
    if moe.shared_expert_gate:   # Qwen2-MoE: beside the shared expert, one row
        weights.shared_gate = reader.read(p + "shared_expert_gate.weight", (1, hidden))
    return weights


def _read_correction_bias(reader: _TensorReader, cfg: ModelConfig, p: str) -> torch.Tensor:
    """A MoE block's (prefix p) routing correction bias [num_experts], float32: the router's e_score_correction_bias,
    or ERNIE 4.5's [1, num_experts] under the block's moe_statics (as published and as transformers saves it), or
    under its router's (gate.moe_statics, as transformers names it in memory). MiniMax-M2's and K-EXAONE's lie beside
    the router (K-EXAONE's also under it, as transformers names it in memory); Trinity's, its expert_bias, too."""
    num_experts = cfg.moe.num_experts
    if cfg.model_type == "afmoe":
        return reader.read(p + "expert_bias", (num_experts,), dtype=torch.float32)
    beside = p + "e_score_correction_bias"
    if cfg.model_type == "minimax_m2" or (cfg.model_type == "exaone_moe" and reader.has(beside)):
        return reader.read(beside, (num_experts,), dtype=torch.float32)
    if cfg.model_type != "ernie4_5_moe":
        return reader.read(p + "gate.e_score_correction_bias", (num_experts,), dtype=torch.float32)
    name = p + "moe_statics.e_score_correction_bias"
    if not reader.has(name) and reader.has(p + "gate.moe_statics.e_score_correction_bias"):
        name = p + "gate.moe_statics.e_score_correction_bias"
    return reader.read(name, (1, num_experts), dtype=torch.float32).view(num_experts)


def _read_stacked_experts(reader: _TensorReader, cfg: ModelConfig, p: str, experts: range,
                          names: tuple[str, str] = ("gate_up_proj", "down_proj")) -> tuple[torch.Tensor, torch.Tensor]:
    """`experts` of a layer's stacked expert projections, in the engine's layout: gate_up_proj [E, 2 * inter, hidden]
    (each expert's gate rows, then its up rows) and down_proj [E, hidden, inter], as transformers keeps them in
    memory and saves them now. Qwen3-VL-MoE's checkpoints as published store both transposed (gate_up_proj
    [E, hidden, 2 * inter], gate columns first; down_proj [E, inter, hidden]); those are read and transposed one
    expert at a time into a preallocated stack. The layout is told by the shapes, as transformers tells it: where
    both fit (hidden == 2 * inter or hidden == inter), the engine's; Llama 4's (TRANSPOSED_EXPERT_TYPES) always the
    transposed one. names: the two tensors' names after p (Granite MoE's input_linear.weight and
    output_linear.weight: STACKED_EXPERT_NAMES)."""
    hidden, inter, num_experts = cfg.hidden_size, cfg.moe.intermediate_size, cfg.moe.num_experts
    stacked = {names[0]: (2 * inter, hidden), names[1]: (hidden, inter)}
    read = []
    for name, (rows, cols) in stacked.items():
        shape = reader.shape(p + name)
        if cfg.model_type not in TRANSPOSED_EXPERT_TYPES and (shape != (num_experts, cols, rows) or rows == cols):
            read.append(reader.read(p + name, (num_experts, rows, cols), rows=experts))
            continue
        stored = reader.read(p + name, (num_experts, cols, rows), rows=experts)
        ours = torch.empty((len(experts), rows, cols), dtype=reader.dtype, device=reader.device)
        for local in range(len(experts)):
            ours[local] = stored[local].T
        del stored
        read.append(ours)
    return read[0], read[1]


def _read_gpt_oss_moe(reader: _TensorReader, cfg: ModelConfig, i: int, experts: range) -> MoEWeights:
    """gpt-oss's biased router (whole) and this rank's `experts`. Its checkpoints store each projection of all
    experts as one tensor whose gate and up outputs alternate (gate, up, gate, ...): in bfloat16 transposed,
    gate_up_proj [E, hidden, 2 * inter] and down_proj [E, inter, hidden]; in MXFP4 (engine.mxfp4) as
    gate_up_proj_blocks/_scales over rows [E, 2 * inter] and down_proj_blocks/_scales over rows [E, hidden].
    Either way they are read into the engine's layout ([E, 2 * inter, hidden], gate rows first), one expert
    at a time into a preallocated stack; the biases alike."""
    moe, p = cfg.moe, f"model.layers.{i}.mlp."
    hidden, inter, num_experts = cfg.hidden_size, moe.intermediate_size, moe.num_experts
    gate_up = torch.empty((len(experts), 2 * inter, hidden), dtype=reader.dtype, device=reader.device)
    down = torch.empty((len(experts), hidden, inter), dtype=reader.dtype, device=reader.device)
    if reader.has(p + "experts.gate_up_proj_blocks"):
        packed = {name: _read_mxfp4(reader, p + f"experts.{name}_proj", (num_experts, rows, cols), experts)
                  for name, rows, cols in (("gate_up", 2 * inter, hidden), ("down", hidden, inter))}
        (gate_up_blocks, gate_up_scales), (down_blocks, down_scales) = packed["gate_up"], packed["down"]
        for local in range(len(experts)):
            gate_up[local] = _gate_rows_first(mxfp4.dequantize(gate_up_blocks[local], gate_up_scales[local],
                                                               reader.dtype))
            down[local] = mxfp4.dequantize(down_blocks[local], down_scales[local], reader.dtype)
    else:
        stored_gate_up = reader.read(p + "experts.gate_up_proj", (num_experts, hidden, 2 * inter), rows=experts)
        stored_down = reader.read(p + "experts.down_proj", (num_experts, inter, hidden), rows=experts)
        for local in range(len(experts)):
            gate_up[local] = _gate_rows_first(stored_gate_up[local].T)
            down[local] = stored_down[local].T
        del stored_gate_up, stored_down
    router = reader.read(p + "router.weight", (num_experts, hidden))
    weights = MoEWeights(router, gate_up, down, moe.num_experts_per_tok, moe.norm_topk_prob, swiglu=moe.swiglu)
    weights.router_bias = reader.read(p + "router.bias", (num_experts,))
    gate_up_bias = reader.read(p + "experts.gate_up_proj_bias", (num_experts, 2 * inter), rows=experts)
    weights.gate_up_bias = _gate_rows_first(gate_up_bias.T).T.contiguous()
    weights.down_bias = reader.read(p + "experts.down_proj_bias", (num_experts, hidden), rows=experts)
    return weights


def _gate_rows_first(rows: torch.Tensor) -> torch.Tensor:
    """A gate/up projection's rows [2 * inter, ...] stored alternating (gate, up, gate, ...) as gate rows, then up."""
    return torch.cat((rows[0::2], rows[1::2]))


def _read_mxfp4(reader: _TensorReader, name: str, shape: tuple[int, int, int],
                experts: range) -> tuple[torch.Tensor, torch.Tensor]:
    """The MXFP4 weight `name` [E, rows, cols]'s blocks and scales (uint8, as stored, on the CPU), of `experts`:
    from a compressed checkpoint as from the original, which `edgefire compress` copies them from unchanged."""
    num_experts, rows, cols = shape
    if cols % mxfp4.VALUES_PER_BLOCK:
        raise CheckpointError(f"tensor {name!r}: {cols} columns do not split into MXFP4 blocks of "
                              f"{mxfp4.VALUES_PER_BLOCK}")
    groups = cols // mxfp4.VALUES_PER_BLOCK
    parts = []
    for suffix, part_shape in (("_blocks", (num_experts, rows, groups, mxfp4.BYTES_PER_BLOCK)),
                               ("_scales", (num_experts, rows, groups))):
        stored = name + suffix
        tensor = reader.read_as_stored(stored, part_shape, rows=experts)
        if tensor.dtype != torch.uint8:
            raise CheckpointError(f"tensor {stored!r} is stored as {str(tensor.dtype).removeprefix('torch.')}; MXFP4 "
                                  f"blocks and scales are uint8")
        parts.append(tensor)
    return parts[0], parts[1]


def _read_lm_head(reader: _TensorReader, cfg: ModelConfig, shard: RankShard,
                  embed: torch.Tensor | None) -> torch.Tensor | None:
    """The output projection. With tie_word_embeddings it is the embedding, unless the checkpoint also
    stores a different lm_head.weight: transformers then leaves the two untied, and so does this. None for
    a bare backbone without one (it serves embeddings only)."""
    full = (cfg.vocab_size, cfg.hidden_size)
    if not reader.has("lm_head.weight"):
        if not cfg.tie_word_embeddings and reader.stored.get("model.embed_tokens.weight") == "embed_tokens.weight":
            return None
        if not cfg.tie_word_embeddings:
            raise CheckpointError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        return embed if embed is not None else reader.read("model.embed_tokens.weight", full, rows=shard.vocab)
    lm_head = reader.read("lm_head.weight", full, rows=shard.vocab)
    if cfg.tie_word_embeddings and embed is not None and torch.equal(lm_head, embed):
        return embed   # one copy in memory
    if cfg.tie_word_embeddings:
        log.warning("tie_word_embeddings is true but the checkpoint's lm_head.weight differs from the embedding; "
                    "using lm_head.weight, as transformers does")
    return lm_head


def _check_all_read(reader: _TensorReader, cfg: ModelConfig, shard: RankShard) -> None:
    """Every tensor of the checkpoint this rank was to read was read: a tensor the config does not account
    for (a layer past num_hidden_layers, a bias the config turns off) would otherwise be dropped silently."""
    last_layer = cfg.num_layers + cfg.num_nextn_layers   # DeepSeek-V3's and GLM-4.5's multi-token-prediction layers
    unread = sorted(reader.stored[name] for name in reader.stored
                    if name not in reader.names_read and not name.endswith(IGNORED_SUFFIXES)
                    and (_wanted(name, shard) or _layer_of(name) is not None and _layer_of(name) >= last_layer))
    if unread:
        more = f" and {len(unread) - 5} more" if len(unread) > 5 else ""
        raise CheckpointError(f"checkpoint has tensors its config.json does not account for: "
                              f"{', '.join(repr(n) for n in unread[:5])}{more} (num_hidden_layers {cfg.num_layers}, "
                              f"attention_bias, mlp_bias and tie_word_embeddings must describe the weights)")


def load_model(model_dir: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               show_progress: bool = True, weight_mode: str = "decompress_on_load", shard: RankShard | None = None,
               tp_group=None, expert_group=None) -> CausalLM:
    """The model, or under TP/PP/EP only `shard`'s part of it (tp_group: its stage's TP process group;
    expert_group: the ranks sharing its experts)."""
    if weight_mode not in WEIGHT_MODES:
        raise ValueError(f"weight_mode {weight_mode!r} is not one of {', '.join(WEIGHT_MODES)}")
    model_dir = Path(model_dir)
    shard = shard or whole_model(cfg)
    files = checkpoint_files(model_dir)
    compressed = open_checkpoint(model_dir, files)
    keep_compressed = weight_mode == "compressed_in_memory"
    if keep_compressed and device.type == "cuda" and not uses_kernel(device):
        raise ValueError("weight_mode compressed_in_memory on a GPU decodes with the Triton kernel: install triton "
                         "(pip install 'edgefire[gpu]') and leave EDGEFIRE_DISABLE_KERNELS unset, or use "
                         "decompress_on_load")
    if keep_compressed and compressed is None:
        log.warning("%s is not a compressed checkpoint (edgefire compress makes one): weight_mode "
                    "compressed_in_memory has nothing to keep compressed; loading it plainly", model_dir)
    if keep_compressed and compressed is not None and shard.tp_size > 1:
        raise ValueError("weight_mode compressed_in_memory keeps whole MLP weights, which tensor parallelism splits; "
                         "use decompress_on_load with tensor_parallel_size > 1")
    names = compressed.names() if compressed else files
    stored = text_model_names(names, cfg)
    if cfg.image_text_checkpoint and shard.rank == 0:
        log.info("%s is an image-and-text checkpoint: serving its text model only; its image encoder and projector "
                 "(%d tensors) are not loaded, so the model takes no images", model_dir, len(names) - len(stored))
    total = sum(1 for name in stored if _wanted(name, shard))
    with tqdm(total=total, desc=f"loading {model_dir.name}", unit="tensor", disable=not show_progress) as bar:
        reader = _TensorReader(files, device, dtype, bar, compressed, stored)
        full = (cfg.vocab_size, cfg.hidden_size)
        embed = reader.read("model.embed_tokens.weight", full, rows=shard.vocab) if shard.is_first_stage else None
        read = [_read_layer(reader, cfg, i, shard, keep_compressed) for i in shard.layers]
        norm = norm_bias = lm_head = None
        if shard.is_last_stage:
            norm = _read_norm(reader, cfg, "model.norm.weight", cfg.hidden_size)
            norm_bias = reader.read("model.norm.bias", (cfg.hidden_size,)) if cfg.norm_bias else None
        if shard.computes_logits:
            lm_head = _read_lm_head(reader, cfg, shard, embed)
        _check_all_read(reader, cfg, shard)
    layers = [layer for layer, _ in read]
    mlps = [mlp for _, mlp in read]
    if any(mlps):
        layers = StreamedLayers(layers, mlps, device, dtype)
    elif keep_compressed and compressed is not None:
        log.warning("%s: no layer has all its MLP projections compressed (a mixture of experts' experts, MXFP4 ones "
                    "included, are expanded at load); loading them plainly", model_dir)
    log.info("loaded %s: %d of %d layers, %s on %s%s", model_dir, len(layers), cfg.num_layers, dtype, device,
             " (compressed checkpoint)" if compressed else "")
    weights = ModelWeights(embed, layers, norm, lm_head, norm_bias)
    return CausalLM(cfg, weights, device, dtype, shard, tp_group, expert_group)
