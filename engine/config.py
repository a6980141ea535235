"""Model configuration: the subset of a Hugging Face `config.json` the engine needs, validated."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import CheckpointError, UnsupportedModelError

# model_type -> whether q/k/v projections carry a bias regardless of `attention_bias`
SUPPORTED_MODEL_TYPES = {"llama": False, "mistral": False, "qwen2": True, "qwen3": False,
                         "mixtral": False, "qwen3_moe": False}
QK_NORM_MODEL_TYPES = {"qwen3", "qwen3_moe"}


@dataclass(slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(slots=True)
class MoEConfig:
    """A mixture-of-experts MLP: each token's hidden state goes to its top-k of num_experts experts."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int       # of one expert
    norm_topk_prob: bool         # renormalize the top-k router probabilities to sum to 1
    sparse_layers: list[bool]    # per layer: MoE (True) or the dense MLP of intermediate_size (False)


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False
    # Per layer: attention window in tokens, or None for full attention.
    sliding_windows: list[int | None] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    moe: MoEConfig | None = None

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and self.moe.sparse_layers[layer]

    def num_parameters(self) -> int:
        """Weights the engine keeps resident: every expert of every MoE layer counts, not just the active ones."""
        from engine.memory import shard_parameters   # counts any rank's part (engine.parallel.layout)
        from engine.parallel.layout import whole_model

        return shard_parameters(self, whole_model(self))


def _require(raw: dict, key: str, path: Path):
    if key not in raw or raw[key] is None:
        raise CheckpointError(f"{path}: missing required field {key!r}")
    return raw[key]


def _parse_rope(raw: dict, path: Path) -> RopeConfig:
    # Newer checkpoints nest everything under rope_parameters; older ones use rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ("default", "llama3"):
        raise UnsupportedModelError(f"{path}: rope type {rope_type!r} is not supported (supported: default, llama3)")
    rope = RopeConfig(theta=float(theta), rope_type=rope_type)
    if rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in merged:
                raise CheckpointError(f"{path}: llama3 rope scaling lacks {key!r}")
        rope.factor = float(merged["factor"])
        rope.low_freq_factor = float(merged["low_freq_factor"])
        rope.high_freq_factor = float(merged["high_freq_factor"])
        rope.original_max_position_embeddings = int(merged["original_max_position_embeddings"])
    return rope


def _parse_sliding_windows(raw: dict, model_type: str, num_layers: int) -> list[int | None]:
    window = raw.get("sliding_window")
    if model_type in ("mistral", "mixtral"):
        return [window] * num_layers
    if model_type == "qwen3_moe":
        return [window if raw.get("use_sliding_window") else None] * num_layers
    layer_types = raw.get("layer_types")
    if layer_types and window:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    if raw.get("use_sliding_window") and window:
        first_full = raw.get("max_window_layers", num_layers)
        return [window if i >= first_full else None for i in range(num_layers)]
    return [None] * num_layers


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _positive_int(raw: dict, keys: tuple[str, ...], path: Path) -> int:
    """The first of `keys` present in the config (checkpoints name some fields differently), as an int >= 1."""
    for key in keys:
        if raw.get(key) is not None:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(f"{path}: {key} must be a positive integer, got {value!r}")
            return value
    raise CheckpointError(f"{path}: missing required field {keys[0]!r}")


def _parse_moe(raw: dict, model_type: str, num_layers: int, path: Path) -> MoEConfig | None:
    if model_type not in ("mixtral", "qwen3_moe"):
        return None
    num_experts = _positive_int(raw, ("num_local_experts", "num_experts"), path)
    top_k = _positive_int(raw, ("num_experts_per_tok",), path)
    if top_k > num_experts:
        raise CheckpointError(f"{path}: num_experts_per_tok {top_k} exceeds the {num_experts} experts")
    if model_type == "mixtral":
        return MoEConfig(num_experts, top_k, _positive_int(raw, ("intermediate_size",), path), True,
                         [True] * num_layers)
    # Qwen3-MoE: a layer is sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid.
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in dense):
        raise CheckpointError(f"{path}: mlp_only_layers must list layer indices in [0, {num_layers}), got {dense!r}")
    step = _positive_int(raw, ("decoder_sparse_step",), path) if "decoder_sparse_step" in raw else 1
    sparse = [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
    return MoEConfig(num_experts, top_k, _positive_int(raw, ("moe_intermediate_size",), path),
                     bool(raw.get("norm_topk_prob", False)), sparse)


def parse_config(raw: dict, path: Path) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = raw.get("architectures")
        raise UnsupportedModelError(
            f"{path}: model_type {model_type!r} (architectures {archs}) is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    hidden = int(_require(raw, "hidden_size", path))
    num_heads = int(_require(raw, "num_attention_heads", path))
    num_layers = int(_require(raw, "num_hidden_layers", path))
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    if num_heads % num_kv_heads:
        raise CheckpointError(f"{path}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{path}: hidden_act {raw.get('hidden_act')!r} is not supported (only silu)")
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(_require(raw, "vocab_size", path)),
        hidden_size=hidden,
        intermediate_size=int(_require(raw, "intermediate_size", path)),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_parse_rope(raw, path),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=SUPPORTED_MODEL_TYPES[model_type] or bool(raw.get("attention_bias", False)),
        qk_norm=model_type in QK_NORM_MODEL_TYPES,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        sliding_windows=_parse_sliding_windows(raw, model_type, num_layers),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_as_id_list(raw.get("eos_token_id")),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        moe=_parse_moe(raw, model_type, num_layers, path),
    )


def read_json(path: Path, required: bool = True) -> dict | None:
    """A checkpoint's JSON file as an object; None when absent and not required."""
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path} is missing")
        return None
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def load_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json; is this a Hugging Face checkpoint directory?")
    return parse_config(read_json(path), path)
