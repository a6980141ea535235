"""GLM-4.1V (glm4v: GLM-4.1V-9B-Thinking) and GLM-4.5V / GLM-4.6V (glm4v_moe) served as their text model, a GLM-4
and a GLM-4.5: on text prompts the engine computes what transformers' Glm4vForConditionalGeneration and
Glm4vMoeForConditionalGeneration (and their text models) compute. Where their text models differ from GLM-4's and
GLM-4.5's: GLM-4.1V's heads are hidden_size // num_attention_heads dims with q/k/v biases, its rotary all of each head
unless partial_rotary_factor says less; GLM-4.5V's head_dim is read, half of it rotated unless told otherwise, no q/k
norms; both rotate by M-RoPE, for text the 1D rope of its frequencies. The image encoder is never read.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import ops
from engine.config import parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import save_and_read_back
from tests.engine.family_checks import DECODE_PATHS, check_decode_path, save_per_expert
from tests.engine.test_image_text_checkpoints import TEXT
from tests.engine.test_moe import check_against_transformers, random_prompts
from tests.engine.test_parallel import PROMPT, Engines, assert_prompt_logits

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

VISION = {"depth": 1, "hidden_size": 32, "out_hidden_size": 64, "intermediate_size": 64, "num_heads": 2,
          "patch_size": 14, "spatial_merge_size": 2, "image_size": 28}
ROPE = {"rope_type": "default", "rope_theta": 300.0, "mrope_section": [2, 3, 3]}   # 8 rotary frequencies


def _glm4v(**text_edits):
    # 32-dim heads, half of each rotated (16 dims: 8 frequencies)
    text = {**TEXT, "hidden_size": 128, "rope_parameters": {**ROPE, "partial_rotary_factor": 0.5}, **text_edits}
    config = transformers.Glm4vConfig(text_config=text, vision_config={**VISION, "out_hidden_size": 128})
    return transformers.Glm4vForConditionalGeneration(config)


def _glm4v_moe(**text_edits):
    # head_dim 32 (not hidden_size // num_attention_heads, 16), half rotated by default; layer 0 dense, 6 experts in
    # 2 groups, 2 per token
    text = {**TEXT, "head_dim": 32, "rope_parameters": ROPE, "num_hidden_layers": 3, "moe_intermediate_size": 48,
            "n_routed_experts": 6, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
            "routed_scaling_factor": 2.5, **text_edits}
    config = transformers.Glm4vMoeConfig(text_config=text, vision_config=VISION)
    return transformers.Glm4vMoeForConditionalGeneration(config)


VARIANTS = {
    "glm4v": lambda: _glm4v(),
    # no partial_rotary_factor: every dim of the 16-dim heads rotates (GLM-4's default would rotate half)
    "glm4v-full-rotary": lambda: _glm4v(hidden_size=64, rope_parameters=ROPE),
    "glm4v-moe": lambda: _glm4v_moe(),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, save_and_read_back(directory, VARIANTS[request.param])


@DECODE_PATHS
def test_text_prompts_give_transformers_logits_and_greedy_tokens(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "glm4v", "the torch path is checked on GLM-4.1V's layers")


def test_the_text_model_alone_gives_the_same_logits(variant):
    name, directory, reference = variant
    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=1 << 20, show_progress=False, block_size=8))
    with torch.no_grad():
        hidden = reference.model.language_model(torch.tensor([PROMPT])).last_hidden_state
        theirs = reference.lm_head(hidden)[0].float()
    torch.testing.assert_close(engine.prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4, msg=name)


def test_the_engine_describes_the_text_model_as_transformers_configures_it(variant):
    name, directory, reference = variant
    cfg = parse_config(json.loads((directory / "config.json").read_text()), directory / "config.json")
    text = reference.config.get_text_config()
    attention = reference.model.language_model.layers[0].self_attn
    assert cfg.image_text_checkpoint and cfg.model_type == ("glm4_moe" if "moe" in name else "glm4")
    assert cfg.head_dim == attention.head_dim and cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm, name
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps) == (
        text.vocab_size, text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads,
        text.rms_norm_eps)
    rotary = reference.model.language_model.rotary_emb
    torch.testing.assert_close(ops.rope_inv_freq(cfg.rotary_dim or cfg.head_dim, cfg.rope, 64), rotary.inv_freq)


def test_experts_stored_one_tensor_each_as_published_load(variant, tmp_path):
    name, directory, reference = variant
    if name != "glm4v-moe":
        pytest.skip("GLM-4.5V's experts only")
    save_per_expert(directory, tmp_path / "published")
    check_against_transformers(tmp_path / "published", reference, random_prompts([9, 20], seed=3), max_tokens=4)


@pytest.fixture(scope="module")
def parallel_engines(tmp_path_factory):
    made = Engines(tmp_path_factory.mktemp("glm4v-parallel"), {"glm4v": VARIANTS["glm4v"],
                                                                "glm4v-moe": VARIANTS["glm4v-moe"]})
    yield made
    made.close()


@pytest.mark.parallel
@pytest.mark.parametrize("name, layout", [("glm4v", (2, 1)), ("glm4v-moe", (2, 1, 2))])
def test_tensor_and_expert_parallel_logits_match_transformers(parallel_engines, name, layout):
    assert_prompt_logits(parallel_engines, name, layout, (1,) * len(layout))


# GLM-4.1V-9B-Thinking's and GLM-4.5V's text_config as transformers' conversion scripts write them (with the values
# the published checkpoints carry: 65536 positions, rope_theta 10000, M-RoPE sections [8, 12, 12]; vision_config left
# out: the engine never reads it)
GLM_4_1V_9B = {
    "architectures": ["Glm4vForConditionalGeneration"], "model_type": "glm4v", "image_start_token_id": 151339,
    "image_end_token_id": 151340, "video_start_token_id": 151341, "video_end_token_id": 151342,
    "image_token_id": 151343, "video_token_id": 151344, "transformers_version": "4.57.1",
    "text_config": {"model_type": "glm4v_text", "attention_bias": True, "attention_dropout": 0.0,
                    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "hidden_act": "silu",
                    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 13696,
                    "max_position_embeddings": 65536, "num_attention_heads": 32, "num_hidden_layers": 40,
                    "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "dtype": "bfloat16", "use_cache": True,
                    "vocab_size": 151552, "tie_word_embeddings": False,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12],
                                        "partial_rotary_factor": 0.5}}}
GLM_4_5V = {
    "architectures": ["Glm4vMoeForConditionalGeneration"], "model_type": "glm4v_moe", "image_start_token_id": 151339,
    "image_end_token_id": 151340, "video_start_token_id": 151341, "video_end_token_id": 151342,
    "image_token_id": 151363, "video_token_id": 151364, "transformers_version": "4.57.0.dev0",
    "text_config": {"model_type": "glm4v_moe_text", "attention_bias": True, "use_qk_norm": False,
                    "attention_dropout": 0.0, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338],
                    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
                    "intermediate_size": 10944, "max_position_embeddings": 65536, "num_attention_heads": 96,
                    "num_hidden_layers": 46, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "dtype": "bfloat16",
                    "use_cache": True, "vocab_size": 151552, "partial_rotary_factor": 0.5,
                    "tie_word_embeddings": False, "moe_intermediate_size": 1408, "n_group": 1,
                    "n_routed_experts": 128, "n_shared_experts": 1, "norm_topk_prob": True, "num_experts_per_tok": 8,
                    "first_k_dense_replace": 1, "routed_scaling_factor": 1.0, "topk_group": 1,
                    "rope_scaling": {"rope_type": "default", "mrope_section": [8, 12, 12]}, "rope_theta": 10000.0}}
# ... and with every text field omitted that transformers' defaults can run with (its defaults alone rotate 64 and 21
# dims, which M-RoPE's [8, 12, 12] sections cannot split: refused below)
PUBLISHED = {"glm-4.1v-9b": (GLM_4_1V_9B, "Glm4vConfig"), "glm-4.5v": (GLM_4_5V, "Glm4vMoeConfig"),
             "glm4v-defaults": ({"model_type": "glm4v", "text_config": {"partial_rotary_factor": 0.5}},
                                "Glm4vConfig"),
             "glm4v-moe-defaults": ({"model_type": "glm4v_moe", "text_config": {"head_dim": 128}}, "Glm4vMoeConfig")}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_config_reads_as_transformers_reads_it(name):
    raw, config_class = PUBLISHED[name]
    cfg = parse_config(raw, Path("config.json"))
    kwargs = copy.deepcopy({k: v for k, v in raw.items() if k != "model_type"})   # transformers edits its rope dicts
    text = getattr(transformers, config_class)(**kwargs).get_text_config()
    head_dim = (getattr(text, "head_dim", None) if "Moe" in config_class else None) or \
        text.hidden_size // text.num_attention_heads
    factor = text.rope_parameters.get("partial_rotary_factor", 1.0)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.rotary_dim or cfg.head_dim, cfg.max_position_embeddings, cfg.rms_norm_eps,
            cfg.rope.theta) == (
        text.vocab_size, text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
        text.num_key_value_heads, head_dim, int(head_dim * factor), text.max_position_embeddings, text.rms_norm_eps,
        text.rope_parameters["rope_theta"])
    eos = getattr(text, "eos_token_id", None)
    assert cfg.eos_token_ids == ([] if eos is None else eos) and cfg.tie_word_embeddings is False
    assert cfg.image_text_checkpoint and cfg.qkv_bias and not cfg.qk_norm and cfg.rope.rope_type == "default"
    if cfg.moe is not None:
        moe = cfg.moe
        assert (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size, moe.norm_topk_prob) == (
            text.n_routed_experts, text.num_experts_per_tok, text.moe_intermediate_size, text.norm_topk_prob)
        assert moe.sparse_layers == [i >= text.first_k_dense_replace for i in range(cfg.num_layers)]


@pytest.mark.parametrize("raw, error, message", [
    ({**GLM_4_1V_9B, "text_config": {**GLM_4_1V_9B["text_config"], "head_dim": 64}}, UnsupportedModelError,
     "head_dim 64 is not supported for glm4v_text"),
    ({**GLM_4_1V_9B, "text_config": {**GLM_4_1V_9B["text_config"], "model_type": "glm4v_moe_text"}},
     UnsupportedModelError, "text_config's model_type 'glm4v_moe_text' is not supported for model_type 'glm4v'"),
    ({**GLM_4_5V, "text_config": {**GLM_4_5V["text_config"], "partial_rotary_factor": 1.0}}, CheckpointError,
     "mrope_section \\[8, 12, 12\\] must count the 64 rotary frequencies"),
    ({**GLM_4_5V, "text_config": {**GLM_4_5V["text_config"], "hidden_act": "gelu"}}, UnsupportedModelError,
     "text_config: hidden_act 'gelu' is not supported"),
    ({"model_type": "glm4v", "text_config": {}}, CheckpointError,
     "mrope_section \\[8, 12, 12\\] must count the 64 rotary frequencies of each head \\(128 rotary dims\\)"),
    ({"model_type": "glm4v_moe", "text_config": {}}, UnsupportedModelError,
     "partial_rotary_factor 0.5 leaves 21 of the 42 head dims to rotate"),
], ids=["glm4v-head-dim", "glm4v-moe-text", "mrope-section", "act", "glm4v-defaults", "glm4v-moe-defaults"])
def test_configs_the_text_path_cannot_follow_are_refused_naming_the_key(raw, error, message):
    with pytest.raises(error, match=message):
        parse_config(raw, Path("config.json"))


def test_the_multi_token_prediction_layer_stored_after_the_decoder_is_not_read(variant, tmp_path):
    # GLM-4.5V's checkpoints store one after num_hidden_layers (transformers skips it on load)
    name, directory, reference = variant
    if name != "glm4v-moe":
        pytest.skip("GLM-4.5V's layer only")
    save_per_expert(directory, tmp_path / "mtp")
    path = tmp_path / "mtp" / "model.safetensors"
    tensors = load_file(path)
    tensors["model.language_model.layers.3.eh_proj.weight"] = torch.full((64, 128), float("nan"))
    save_file(tensors, str(path), metadata={"format": "pt"})
    engine = LLMEngine(tmp_path / "mtp", EngineConfig(kv_cache_bytes=1 << 20, show_progress=False, block_size=8))
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(engine.prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)
