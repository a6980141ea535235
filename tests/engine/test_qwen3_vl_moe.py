"""Qwen3-VL-MoE checkpoints (Qwen3-VL-30B-A3B, -235B-A22B) served as their text model, a Qwen3-MoE: on text prompts
the engine computes what transformers' Qwen3VLMoeForConditionalGeneration computes, from the experts stacked as
transformers saves them now (gate_up_proj [E, 2 * inter, hidden], down_proj [E, hidden, inter]) and as the
checkpoints were published (both transposed), dense layers placed by mlp_only_layers or decoder_sparse_step, the
router's top-k always renormalized; under tensor and expert parallelism each rank reads only its experts. The image
encoder is never read (test_image_text_checkpoints.py shows it for the other image-and-text checkpoints).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import parse_config
from engine.errors import CheckpointError, UnsupportedModelError
from engine.engine import EngineConfig, LLMEngine
from tests.engine.conftest import save_and_read_back
from tests.engine.test_image_text_checkpoints import MROPE, QWEN3_VL_VISION, TEXT
from tests.engine.test_moe import check_against_transformers, random_prompts
from tests.engine.test_parallel import Engines, assert_prompt_logits

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

# Three layers, the middle one dense (mlp_only_layers); 6 experts, 3 per token; expert shapes no square fits twice
MOE = {"head_dim": 16, "num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 48,
       "mlp_only_layers": [1], "num_hidden_layers": 3}
STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _qwen3_vl_moe(**text_edits):
    text = {**TEXT, **MOE, "rope_parameters": {**MROPE, "mrope_interleaved": True}, **text_edits}
    config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=QWEN3_VL_VISION)
    return transformers.Qwen3VLMoeForConditionalGeneration(config)


def _as_published(directory: Path) -> None:
    """The checkpoint as Qwen3-VL-MoE's were published: each stacked expert tensor transposed (gate_up_proj
    [E, hidden, 2 * inter], down_proj [E, inter, hidden]), num_experts spelled so, rope_theta beside rope_scaling."""
    path = directory / "model.safetensors"
    tensors = {name: t.transpose(1, 2).contiguous() if name.endswith(STACKED) else t
               for name, t in load_file(path).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    config_path = directory / "config.json"
    raw = json.loads(config_path.read_text())
    text = raw["text_config"]
    text["num_experts"] = text.pop("num_local_experts")
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = rope
    config_path.write_text(json.dumps(raw))


# name -> (the model, how its saved checkpoint is rewritten)
VARIANTS = {
    "as-saved": (_qwen3_vl_moe, None),
    "as-published": (_qwen3_vl_moe, _as_published),
    # every second layer sparse (only layer 1), nothing in mlp_only_layers
    "sparse-step-2": (lambda: _qwen3_vl_moe(decoder_sparse_step=2, mlp_only_layers=[]), None),
    # experts half as wide as the model: gate_up_proj [E, 2 * inter, hidden] is square per expert, so its shape
    # cannot tell the layout, which is then transformers' own as saved (not the transposed one published)
    "as-saved-square": (lambda: _qwen3_vl_moe(moe_intermediate_size=TEXT["hidden_size"] // 2), None),
}


def _save(directory: Path, name: str):
    """The checkpoint (random weights) and transformers' model loaded back from it, which reads both layouts."""
    factory, rewrite = VARIANTS[name]
    return save_and_read_back(directory, factory, rewrite, same_weights=True)   # the rewrite kept every weight


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, _save(directory, request.param)


def test_text_prompts_give_transformers_logits_and_greedy_tokens(variant, caplog):
    name, directory, reference = variant
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        check_against_transformers(directory, reference, random_prompts([3, 9, 20, 41], seed=11), max_tokens=6)
    assert any("serving its text model only" in r.getMessage() for r in caplog.records), name


def test_the_experts_are_where_transformers_puts_them(variant):
    name, directory, reference = variant
    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=1 << 20, show_progress=False))
    text = reference.model.language_model
    for ours, theirs in zip(engine.model.weights.layers, text.layers):
        sparse = isinstance(theirs.mlp, transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe.
                            Qwen3VLMoeTextSparseMoeBlock)
        assert (ours.moe is not None) == sparse, name
        if sparse:
            assert torch.equal(ours.moe.gate_up, theirs.mlp.experts.gate_up_proj)
            assert torch.equal(ours.moe.down, theirs.mlp.experts.down_proj)
            assert ours.moe.normalize and ours.moe.top_k == 3


def test_expert_tensors_of_neither_layout_are_an_error(tmp_path):
    _save(tmp_path, "as-saved")
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    name = "model.language_model.layers.0.mlp.experts.down_proj"
    tensors[name] = tensors[name][:, :, :40].contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor '{name}' has shape \\(6, 64, 40\\), config implies "
                                              f"\\(6, 64, 48\\)"):
        LLMEngine(tmp_path, EngineConfig(kv_cache_bytes=1 << 20, show_progress=False))


class PublishedEngines(Engines):
    """test_parallel's engines; the "as-published" checkpoint rewritten as published after it is saved."""

    def checkpoint(self, name: str) -> Path:
        saved = name in self.references
        directory = super().checkpoint(name)
        if not saved and VARIANTS[name][1]:
            VARIANTS[name][1](directory)
        return directory


@pytest.fixture(scope="module")
def parallel_engines(tmp_path_factory):
    made = PublishedEngines(tmp_path_factory.mktemp("qwen3-vl-moe-parallel"),
                            {name: VARIANTS[name][0] for name in ("as-saved", "as-published")})
    yield made
    made.close()


@pytest.mark.parallel
@pytest.mark.parametrize("name", ["as-saved", "as-published"])
def test_tensor_and_expert_parallel_logits_match_transformers(parallel_engines, name):
    # tp=2 with ep=2: each rank its heads and 3 of the 6 experts, read from the file (rank 0: experts 0-2)
    assert_prompt_logits(parallel_engines, name, (2, 1, 2), (1, 1, 1))
    layers = parallel_engines.get(name, (2, 1, 2)).model.weights.layers
    theirs = parallel_engines.references[name].model.language_model.layers
    for i in (0, 2):
        assert torch.equal(layers[i].moe.gate_up, theirs[i].mlp.experts.gate_up_proj[:3])
        assert torch.equal(layers[i].moe.down, theirs[i].mlp.experts.down_proj[:3])


# config.json of Qwen3-VL-30B-A3B-Instruct as published (vision_config left out: the engine never reads it)
QWEN3_VL_30B_A3B = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl_moe",
    "text_config": {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
                    "decoder_sparse_step": 1, "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128,
                    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
                    "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_vl_moe_text",
                    "moe_intermediate_size": 768, "num_attention_heads": 32, "num_experts": 128,
                    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
                    "rms_norm_eps": 1e-06,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                    "rope_theta": 5000000, "use_cache": True, "vocab_size": 151936},
    "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0", "video_token_id": 151656,
    "vision_end_token_id": 151653, "vision_start_token_id": 151652}


@pytest.mark.parametrize("raw", [QWEN3_VL_30B_A3B, {"model_type": "qwen3_vl_moe", "text_config": {}}],
                         ids=["published", "defaults"])
def test_a_config_reads_as_transformers_reads_it(raw):
    cfg = parse_config(raw, Path("config.json"))
    text = transformers.Qwen3VLMoeConfig(**{k: v for k, v in raw.items() if k != "model_type"}).get_text_config()
    assert cfg.model_type == "qwen3_moe" and cfg.image_text_checkpoint and cfg.qk_norm
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.rope.theta) == (
        text.vocab_size, text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
        text.num_key_value_heads, text.head_dim, text.max_position_embeddings, text.rms_norm_eps,
        text.rope_parameters["rope_theta"])
    moe = cfg.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size) == (
        text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size)
    assert moe.norm_topk_prob and moe.sparse_layers == [True] * cfg.num_layers
    assert cfg.rope.rope_type == "default" and cfg.sliding_windows == [None] * cfg.num_layers
    assert cfg.tie_word_embeddings is False


@pytest.mark.parametrize("text_edits, error, message", [
    ({"model_type": "qwen3_vl_text"}, UnsupportedModelError,
     "text_config's model_type 'qwen3_vl_text' is not supported for model_type 'qwen3_vl_moe'"),
    ({"num_experts_per_tok": 200}, CheckpointError, "num_experts_per_tok 200 exceeds the 128 experts"),
    ({"mlp_only_layers": [48]}, CheckpointError, "mlp_only_layers must list layer indices in \\[0, 48\\)"),
    ({"decoder_sparse_step": 0}, CheckpointError, "decoder_sparse_step must be a positive integer"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "text_config: hidden_act 'gelu' is not supported"),
], ids=["dense-text-type", "top-k", "mlp-only-layers", "sparse-step", "act"])
def test_configs_the_text_path_cannot_follow_are_refused_naming_the_key(text_edits, error, message):
    raw = {**QWEN3_VL_30B_A3B, "text_config": {**QWEN3_VL_30B_A3B["text_config"], **text_edits}}
    with pytest.raises(error, match=message):
        parse_config(raw, Path("config.json"))
