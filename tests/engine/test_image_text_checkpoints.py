"""Image-and-text checkpoints served as their text model: Mistral 3 (Mistral Small 3.1/3.2), Qwen2-VL, Qwen2.5-VL and
Qwen3-VL (dense). The engine computes on text prompts what transformers' ForConditionalGeneration computes, from
each one's config as it was published (Qwen2-VL's and Qwen2.5-VL's text fields at the top level, M-RoPE's 'mrope')
and as transformers saves it now (text_config), its text tensors under either of their saved names; the image
encoder is never read. Gemma 3's are tested in test_gemma3_multimodal.py, Qwen3-VL-MoE's in test_qwen3_vl_moe.py,
GLM-4.1V's and GLM-4.5V's in test_glm4v.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import ops
from engine.config import parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import SMALL, save_and_read_back
from tests.engine.test_moe import check_against_transformers, random_prompts
from tests.engine.test_parallel import Engines, assert_prompt_logits

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

# Weights 5x transformers' default scale, so attention (and so the rope) shapes the logits well past the tolerance;
# token ids within the small vocabulary
TEXT = {**SMALL, "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2}
MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 300.0}   # 8 frequencies of 16-dim heads
# Image encoders far smaller than the real ones: one or two layers, 28- or 32-pixel images
PIXTRAL = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 2, "head_dim": 16, "image_size": 28, "patch_size": 14}
QWEN2_VL_VISION = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2, "patch_size": 14,
                   "spatial_merge_size": 2}
QWEN2_5_VL_VISION = {"depth": 1, "hidden_size": 32, "out_hidden_size": 64, "intermediate_size": 64, "num_heads": 2,
                     "patch_size": 14, "spatial_merge_size": 2, "fullatt_block_indexes": [0]}
QWEN3_VL_VISION = {"depth": 2, "hidden_size": 32, "out_hidden_size": 64, "intermediate_size": 64, "num_heads": 2,
                   "patch_size": 16, "spatial_merge_size": 2, "deepstack_visual_indexes": [0],
                   "num_position_embeddings": 16}


def _mistral3(text_type: str = "mistral", tie: bool = False):
    text = {**TEXT, "model_type": text_type, "head_dim": 16, "rope_theta": 300.0}
    text |= {"sliding_window": None} if text_type == "mistral" else {}
    config = transformers.Mistral3Config(text_config=text, vision_config=PIXTRAL, tie_word_embeddings=tie)
    return transformers.Mistral3ForConditionalGeneration(config)


def _qwen2_vl(tie: bool = False):
    config = transformers.Qwen2VLConfig(text_config={**TEXT, "rope_parameters": {**MROPE, "type": "mrope"}},
                                        vision_config=QWEN2_VL_VISION, tie_word_embeddings=tie)
    return transformers.Qwen2VLForConditionalGeneration(config)


def _qwen2_5_vl(tie: bool = False):
    config = transformers.Qwen2_5_VLConfig(text_config={**TEXT, "rope_parameters": {**MROPE, "type": "mrope"}},
                                           vision_config=QWEN2_5_VL_VISION, tie_word_embeddings=tie)
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


def _qwen3_vl(tie: bool = False):
    text = {**TEXT, "head_dim": 16, "rope_parameters": {**MROPE, "mrope_interleaved": True}}
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=QWEN3_VL_VISION, tie_word_embeddings=tie)
    return transformers.Qwen3VLForConditionalGeneration(config)


def _flat(raw: dict) -> dict:
    """A Qwen2-VL/Qwen2.5-VL config.json as first published: the text model's fields at the top level, the rope
    in the older spelling (rope_theta beside rope_scaling {"type": "mrope", "mrope_section"})."""
    text = dict(raw.pop("text_config"))
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    return {**raw, **text, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}


NEWER_NAMES = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
               ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."),
               ("model.", "model.language_model."), ("visual.", "model.visual."))
OLDER_NAMES = (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
               ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."))


def _renamed(name: str, spellings) -> str:
    for theirs, ours in spellings:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


# name -> (the model, how its config.json is rewritten, how its tensors are renamed); the models' classes are
# named only inside the factories, so collecting this module imports no image model of transformers
VARIANTS = {
    # Mistral Small 3.1's shape: a Mistral text model, untied, saved under language_model.* as published
    "mistral3": (lambda: _mistral3(), None, OLDER_NAMES),
    # ... saved as newer transformers save it (model.language_model.*, lm_head)
    "mistral3-newer-names": (lambda: _mistral3(), None, NEWER_NAMES),
    # a Llama text model, tied
    "mistral3-llama-tied": (lambda: _mistral3("llama", tie=True), None, None),
    # Qwen2-VL's config as published (flat, "mrope"), tensors under model.*, visual.*
    "qwen2-vl-flat": (lambda: _qwen2_vl(), _flat, None),
    # Qwen2.5-VL with text_config, tied (as the 3B is), tensors under model.language_model.*, model.visual.*
    "qwen2.5-vl-tied": (lambda: _qwen2_5_vl(tie=True), None, NEWER_NAMES),
    # Qwen2.5-VL as published: flat, untied, model.*
    "qwen2.5-vl-flat": (lambda: _qwen2_5_vl(), _flat, None),
    # Qwen3-VL: q/k norms, interleaved M-RoPE, deepstack (nothing for text)
    "qwen3-vl": (lambda: _qwen3_vl(), None, None),
}
IMAGE_PREFIXES = ("vision_tower.", "multi_modal_projector.", "visual.", "model.vision_tower.",
                  "model.multi_modal_projector.", "model.visual.")


def _save(directory: Path, name: str):
    """The checkpoint (random weights, norms and biases too) and transformers' model loaded back from it."""
    factory, edit_config, spellings = VARIANTS[name]

    def rewrite(directory: Path) -> None:
        if edit_config:
            path = directory / "config.json"
            path.write_text(json.dumps(edit_config(json.loads(path.read_text()))))
        if spellings:
            path = directory / "model.safetensors"
            tensors = {_renamed(n, spellings): t for n, t in load_file(path).items()}
            save_file(tensors, str(path), metadata={"format": "pt"})

    return save_and_read_back(directory, factory, rewrite)   # transformers reads every name


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, _save(directory, request.param)


def test_text_prompts_give_transformers_logits_and_greedy_tokens(variant, caplog):
    # four prompts at once, three longer than a KV block (8), two chunked by the 24-token budget
    name, directory, reference = variant
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        check_against_transformers(directory, reference, random_prompts([3, 9, 20, 41], seed=11), max_tokens=6)
    said = [r.getMessage() for r in caplog.records if "image-and-text" in r.getMessage()]
    assert len(said) == 1 and "serving its text model only" in said[0], name


def test_the_engine_describes_the_text_model_as_transformers_configures_it(variant):
    name, directory, reference = variant
    cfg = parse_config(json.loads((directory / "config.json").read_text()), directory / "config.json")
    text = reference.config.get_text_config()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        text.vocab_size, text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads,
        getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    assert cfg.image_text_checkpoint and cfg.rms_norm_eps == text.rms_norm_eps
    assert cfg.tie_word_embeddings == (reference.lm_head.weight is reference.get_input_embeddings().weight), name
    rotary = reference.model.language_model.rotary_emb
    torch.testing.assert_close(ops.rope_inv_freq(cfg.head_dim, cfg.rope, 64), rotary.inv_freq)


def test_the_image_encoder_is_never_read(tmp_path):
    # The image encoder's tensors moved to a shard of their own, then that shard overwritten with garbage:
    # the engine still loads and computes what transformers computes, never opening the shard.
    directory = tmp_path / "split"
    reference = _save(directory, "qwen2.5-vl-tied")
    tensors = load_file(directory / "model.safetensors")
    image = {name: t for name, t in tensors.items() if name.startswith(IMAGE_PREFIXES)}
    text = {name: t for name, t in tensors.items() if name not in image}
    assert image and all(name.startswith("model.visual.") for name in image)
    (directory / "model.safetensors").unlink()
    save_file(text, str(directory / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    (directory / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 4096)
    weight_map = {name: "model-00001-of-00002.safetensors" for name in text}
    weight_map.update({name: "model-00002-of-00002.safetensors" for name in image})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    check_against_transformers(directory, reference, random_prompts([9, 20], seed=3), max_tokens=4)


@pytest.mark.parametrize("name, missing", [("mistral3", "language_model.model.layers.1.mlp.up_proj.weight"),
                                           ("qwen2.5-vl-tied", "model.language_model.layers.0.self_attn.k_proj.bias"),
                                           ("qwen2-vl-flat", "model.layers.1.self_attn.q_proj.bias")])
def test_a_missing_text_tensor_is_an_error_naming_it_as_the_checkpoint_does(tmp_path, name, missing):
    _save(tmp_path, name)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    assert missing in tensors
    save_file({n: t for n, t in tensors.items() if n != missing}, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"checkpoint is missing tensor '{missing}'"):
        LLMEngine(tmp_path, EngineConfig(kv_cache_bytes=1 << 20, show_progress=False))


@pytest.fixture(scope="module")
def parallel_engines(tmp_path_factory):
    made = Engines(tmp_path_factory.mktemp("image-text-parallel"), {"qwen2.5-vl": _qwen2_5_vl, "qwen3-vl": _qwen3_vl})
    yield made
    made.close()


@pytest.mark.parallel
@pytest.mark.parametrize("name", ["qwen2.5-vl", "qwen3-vl"])
def test_tensor_parallel_logits_match_transformers(parallel_engines, name):
    # 4 heads and 2 KV heads over 2 ranks: each rank its heads' q/k/v rows (and biases, or q/k norms whole)
    assert_prompt_logits(parallel_engines, name, (2, 1), (1, 1))


# config.json as published (vision_config left out: the engine never reads it)
MISTRAL_SMALL_3_1 = {
    "architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
    "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "text_config": {"attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
                    "initializer_range": 0.02, "intermediate_size": 32768, "max_position_embeddings": 131072,
                    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 40,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0,
                    "sliding_window": None, "use_cache": True, "vocab_size": 131072},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "vision_feature_layer": -1}
QWEN2_5_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 128000,
    "max_window_layers": 28, "model_type": "qwen2_5_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064}
QWEN3_VL_8B = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl",
    "text_config": {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
                    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
                    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 262144,
                    "model_type": "qwen3_vl_text", "num_attention_heads": 32, "num_hidden_layers": 36,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                    "rope_theta": 5000000, "use_cache": True, "vocab_size": 151936},
    "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0", "video_token_id": 151656,
    "vision_end_token_id": 151653, "vision_start_token_id": 151652}
PUBLISHED = {"mistral-small-3.1": (MISTRAL_SMALL_3_1, "Mistral3Config", "mistral"),
             "qwen2.5-vl-7b": (QWEN2_5_VL_7B, "Qwen2_5_VLConfig", "qwen2"),
             "qwen3-vl-8b": (QWEN3_VL_8B, "Qwen3VLConfig", "qwen3")}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_published_config_reads_as_transformers_reads_it(name):
    raw, config_class, text_type = PUBLISHED[name]
    cfg = parse_config(raw, Path("config.json"))
    config = getattr(transformers, config_class)(**{k: v for k, v in raw.items() if k != "model_type"})
    text = config.get_text_config()
    assert cfg.model_type == text_type and cfg.image_text_checkpoint
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.max_position_embeddings, cfg.rms_norm_eps) == (
        text.vocab_size, text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
        text.num_key_value_heads, getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        text.max_position_embeddings, text.rms_norm_eps)
    assert cfg.rope.rope_type == "default" and cfg.rope.theta == text.rope_parameters["rope_theta"]
    assert cfg.sliding_windows == [None] * cfg.num_layers
    assert cfg.qkv_bias == (text_type == "qwen2") and cfg.qk_norm == (text_type == "qwen3") and not cfg.o_bias
    assert cfg.tie_word_embeddings is False and cfg.torch_dtype == "bfloat16"


@pytest.mark.parametrize("model_type, config_class", [("qwen2_vl", "Qwen2VLConfig"), ("qwen2_5_vl", "Qwen2_5_VLConfig"),
                                                       ("qwen3_vl", "Qwen3VLConfig")])
def test_omitted_text_fields_default_as_transformers_defaults_them(model_type, config_class):
    cfg = parse_config({"model_type": model_type, "text_config": {}}, Path("config.json"))
    text = getattr(transformers, config_class)(text_config={}).get_text_config()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.rope.theta) == (
        text.vocab_size, text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
        text.num_key_value_heads, getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        text.max_position_embeddings, text.rms_norm_eps, text.rope_parameters["rope_theta"])
    bos, eos = getattr(text, "bos_token_id", None), getattr(text, "eos_token_id", None)
    assert cfg.bos_token_id == bos and cfg.eos_token_ids == ([] if eos is None else [eos])


@pytest.mark.parametrize("raw, error, message", [
    ({**MISTRAL_SMALL_3_1, "text_config": {**MISTRAL_SMALL_3_1["text_config"], "model_type": "mixtral"}},
     UnsupportedModelError, "text_config's model_type 'mixtral' is not supported for model_type 'mistral3'"),
    ({**QWEN3_VL_8B, "model_type": "qwen3_vl_moe"}, UnsupportedModelError,
     "text_config's model_type 'qwen3_vl_text' is not supported for model_type 'qwen3_vl_moe'"),
    ({**QWEN2_5_VL_7B, "rope_scaling": {"type": "mrope", "mrope_section": [64]}}, CheckpointError,
     "rope_scaling: mrope_section must list"),
    ({**QWEN2_5_VL_7B, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24], "mrope_interleaved": "yes"}},
     CheckpointError, "mrope_interleaved must be true or false"),
    ({**QWEN2_5_VL_7B, "hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
    ({**QWEN2_5_VL_7B, "rope_scaling": {"type": "su", "mrope_section": [16, 24, 24]}}, UnsupportedModelError,
     "rope type 'su' is not supported"),
    ({**QWEN3_VL_8B, "text_config": {**QWEN3_VL_8B["text_config"], "hidden_act": "gelu"}}, UnsupportedModelError,
     "text_config: hidden_act 'gelu' is not supported"),
    ({**QWEN2_5_VL_7B, "quantization_config": {"quant_method": "awq"}}, UnsupportedModelError,
     "quantized checkpoints are not supported"),
], ids=["mistral3-other-text", "qwen3-vl-moe", "mrope-section", "mrope-interleaved", "qwen2.5-vl-act", "rope-type",
        "qwen3-vl-act", "awq"])
def test_configs_the_text_path_cannot_follow_are_refused_naming_the_key(raw, error, message):
    with pytest.raises(error, match=message):
        parse_config(raw, Path("config.json"))
