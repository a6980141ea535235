"""Gemma 3's image-and-text checkpoints (model_type gemma3, Gemma3ForConditionalGeneration: gemma-3-4b, -12b,
-27b) served as their text model: the engine computes what transformers computes on text prompts, from
text_config defaulted as transformers defaults it, with the text tensors under either of their saved names
(older saves: language_model.model.*, newer: model.language_model.*). The image encoder and its projector are
never read, and the loader's checks still hold for the text tensors.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import loader
from engine.compression.compress import compress_checkpoint
from engine.config import parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from engine.compression.streamed import StreamedLayers
from tests.engine.test_compression_checkpoint import to_bf16
from tests.engine.test_gemma3 import GEMMA3, _GemmaEngines, _randomize_gemma
from tests.engine.test_moe import check_against_transformers, random_prompts
from tests.engine.test_parallel import assert_prompt_logits
from tests.engine.test_reference import engine_greedy

transformers = pytest.importorskip("transformers")

# A SigLIP image encoder far smaller than the real one: 28-pixel images in 2x2 patches of 14, one layer
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
IMAGE_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def _image_text_model(**text):
    config = transformers.Gemma3Config(text_config={**GEMMA3, **text}, mm_tokens_per_image=4,
                                       vision_config=transformers.SiglipVisionConfig(**VISION).to_dict())
    return transformers.Gemma3ForConditionalGeneration(config)


def _newer_names(name: str) -> str:
    """A tensor's name as transformers 4.52 to 4.57 saved it (the older saves' is what save_pretrained writes)."""
    for older, newer in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                         ("vision_tower.", "model.vision_tower."),
                         ("multi_modal_projector.", "model.multi_modal_projector.")):
        if name.startswith(older):
            return newer + name[len(older):]
    return name


def _rewrite(directory: Path, edit) -> None:
    """Replace model.safetensors' tensors by edit(tensors)."""
    path = directory / "model.safetensors"
    save_file(edit(load_file(path)), str(path), metadata={"format": "pt"})


def _save(directory: Path, spelling: str = "older", **text):
    """The checkpoint (random weights, the norms too) and transformers' model loaded back from it."""
    torch.manual_seed(1234)
    model = _image_text_model(**text).eval()
    _randomize_gemma(model)
    model.save_pretrained(directory)
    names = set(load_file(directory / "model.safetensors"))
    assert any(name.startswith("language_model.model.") for name in names)   # save_pretrained's older names
    if spelling == "newer":
        _rewrite(directory, lambda tensors: {_newer_names(name): tensor for name, tensor in tensors.items()})
    reference, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32,
                                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info   # transformers reads every name
    return reference.eval()


@pytest.fixture(scope="module", params=["older", "newer"])
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"gemma3-image-text-{request.param}")
    return request.param, directory, _save(directory, request.param)


def test_text_prompts_give_transformers_logits_and_greedy_tokens(checkpoint, caplog):
    _, directory, reference = checkpoint
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        check_against_transformers(directory, reference, random_prompts([3, 9, 20, 41], seed=11), max_tokens=6)
    said = [r.getMessage() for r in caplog.records if "image-and-text" in r.getMessage()]
    assert len(said) == 1 and "serving its text model only" in said[0] and "takes no images" in said[0]


def test_the_engine_describes_the_text_model_as_transformers_configures_it(checkpoint):
    # the figures the agent reports (GetModelInfo's vocab_size, KV bytes per token) come from this config
    _, directory, reference = checkpoint
    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=1 << 20, show_progress=False, block_size=8))
    text = reference.config.text_config
    cfg = engine.model_config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (
        text.vocab_size, text.hidden_size, text.num_hidden_layers, text.num_key_value_heads, text.head_dim)
    layout = engine.kv_layout(1)
    assert layout.bytes_per_token_per_layer * layout.num_layers == 2 * 6 * 2 * 16 * 4   # K and V, float32
    assert engine.model.weights.lm_head is engine.model.weights.embed_tokens   # tied, as transformers ties it


def test_the_image_encoder_is_never_read_and_the_progress_counts_the_text_tensors(tmp_path, monkeypatch):
    # The image encoder's tensors moved to a shard of their own, then that shard overwritten with garbage:
    # the engine still loads (it never opens the shard), and its progress bar counts only what it reads.
    directory = tmp_path / "split"
    reference = _save(directory)
    tensors = load_file(directory / "model.safetensors")
    image = {name: t for name, t in tensors.items() if name.startswith(IMAGE_PREFIXES)}
    text = {name: t for name, t in tensors.items() if name not in image}
    assert image and not any(name.endswith("lm_head.weight") for name in text)   # tied: no head stored
    (directory / "model.safetensors").unlink()
    save_file(text, str(directory / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    shard = directory / "model-00002-of-00002.safetensors"
    shard.write_bytes(b"\xff" * 4096)
    weight_map = {name: "model-00001-of-00002.safetensors" for name in text}
    weight_map.update({name: shard.name for name in image})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    bars = []

    class Bar(loader.tqdm):   # the bar's total and the steps it was advanced by (a disabled bar counts none)
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append([self.total, 0])

        def update(self, n=1):
            bars[-1][1] += n
            return super().update(n)

    monkeypatch.setattr(loader, "tqdm", Bar)
    check_against_transformers(directory, reference, random_prompts([9, 20], seed=3), max_tokens=4)
    assert bars == [[len(text), len(text)]]


@pytest.mark.parametrize("spelling", ["older", "newer"])
def test_a_missing_text_tensor_is_an_error_naming_it_as_the_checkpoint_does(tmp_path, spelling):
    directory = tmp_path / spelling
    _save(directory, spelling)
    missing = _newer_names("language_model.model.layers.1.mlp.up_proj.weight") if spelling == "newer" \
        else "language_model.model.layers.1.mlp.up_proj.weight"
    _rewrite(directory, lambda tensors: {name: t for name, t in tensors.items() if name != missing})
    with pytest.raises(CheckpointError, match=f"checkpoint is missing tensor '{missing}'"):
        LLMEngine(directory, EngineConfig(kv_cache_bytes=1 << 20, show_progress=False))


def test_a_text_tensor_the_config_does_not_account_for_is_still_refused(tmp_path):
    directory = tmp_path / "extra"
    _save(directory)
    extra = "language_model.model.layers.6.mlp.up_proj.weight"   # a seventh layer; num_hidden_layers is 6
    _rewrite(directory, lambda tensors: {**tensors, extra: torch.zeros(128, 64)})
    with pytest.raises(CheckpointError, match=f"does not account for: '{extra}'"):
        LLMEngine(directory, EngineConfig(kv_cache_bytes=1 << 20, show_progress=False))


def test_a_compressed_checkpoint_generates_transformers_tokens_in_both_weight_modes(tmp_path):
    # the text MLPs are compressed (so are the image encoder's, which no one reads) and kept compressed in memory
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    _save(original)
    to_bf16(original)
    reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(original, dtype=torch.float32).eval()
    report = compress_checkpoint(original, compressed, chunk_size=64, show_progress=False, say=lambda *_: None)
    assert report.groups["mlp"].num_compressed >= 3 * 6
    prompts = random_prompts([9, 20], seed=5)
    for mode in ("decompress_on_load", "compressed_in_memory"):
        engine = LLMEngine(compressed, EngineConfig(kv_cache_bytes=8 << 20, show_progress=False, dtype="float32",
                                                    max_num_batched_tokens=24, block_size=8, weight_mode=mode))
        assert isinstance(engine.model.weights.layers, StreamedLayers) == (mode == "compressed_in_memory")
        ours = engine_greedy(engine, prompts, 5)
        for prompt, tokens in zip(prompts, ours):
            with torch.no_grad():
                theirs = reference(torch.tensor([prompt + tokens[:-1]])).logits[0]
            assert theirs[len(prompt) - 1:].argmax(-1).tolist() == tokens, mode


@pytest.fixture(scope="module")
def parallel_engines(tmp_path_factory):
    made = _GemmaEngines(tmp_path_factory.mktemp("gemma3-image-text-parallel"),
                             {"gemma3-image-text": _image_text_model})
    yield made
    made.close()


@pytest.mark.parallel
def test_tensor_parallel_logits_match_transformers(parallel_engines):
    assert_prompt_logits(parallel_engines, "gemma3-image-text", (2, 1), (1, 1))


# gemma-3-4b-it's config.json as published: text_config lists only what differs from transformers' defaults
# (no vocab_size, head counts or head_dim), the stop tokens are at the top level
PUBLISHED_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
                "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
                "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
                "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                "sliding_window": 1024},
                "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
                "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                  "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                  "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def test_a_published_config_reads_as_transformers_reads_it():
    from engine import ops

    cfg = parse_config(PUBLISHED_4B, Path("config.json"))
    config = transformers.Gemma3Config(**{k: v for k, v in PUBLISHED_4B.items() if k != "model_type"})
    text = config.text_config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        text.vocab_size, text.hidden_size, text.intermediate_size, text.num_hidden_layers)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        text.num_attention_heads, text.num_key_value_heads, text.head_dim)
    assert cfg.attention_multiplier == text.query_pre_attn_scalar ** -0.5
    assert cfg.sliding_windows == [text.sliding_window if kind == "sliding_attention" else None
                                   for kind in text.layer_types]
    assert cfg.tie_word_embeddings is config.tie_word_embeddings is True
    assert cfg.eos_token_ids == [1, 106] and cfg.bos_token_id == 2 and cfg.torch_dtype == "bfloat16"
    rotary = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(text)
    for rope, kind in ((cfg.rope, "full_attention"), (cfg.local_rope, "sliding_attention")):
        torch.testing.assert_close(ops.rope_inv_freq(cfg.head_dim, rope, 64), getattr(rotary, f"{kind}_inv_freq"))
    assert cfg.image_text_checkpoint


def test_a_text_config_of_another_kind_is_refused_naming_it():
    raw = {**PUBLISHED_4B, "text_config": {**PUBLISHED_4B["text_config"], "model_type": "gemma2"}}
    with pytest.raises(UnsupportedModelError, match="text_config's model_type 'gemma2' is not supported"):
        parse_config(raw, Path("config.json"))
