"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 checkpoints (`glm4_moe`): the engine computes what transformers computes on the
same random-weight checkpoint, read from the same config.json.

GLM's attention is grouped-query with q/k/v biases (attention_bias; o_proj never has one), per-head q/k norms when
use_qk_norm is true, and rotary (rotate-half) on each head's first partial_rotary_factor of dims; its first
first_k_dense_replace layers have a dense MLP, the later ones DeepSeek-V3's mixture of experts (sigmoid scores, a
correction bias steering the choice, groups, routed_scaling_factor, shared experts). Each checkpoint has one dense
and two MoE layers; prompts are chunked and batched beside decode rows, on the C decode loop and on the torch path,
and also run at tp=2 + ep=2 and ep=2, from a compressed copy, and with a multi-token-prediction layer stored past
the decoder's (which the engine leaves unread, as transformers does).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import ops
from engine.compression.compress import compress_checkpoint
from engine.config import load_config, parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import SMALL, save_random_checkpoint
from tests.engine.family_checks import DECODE_PATHS, check_decode_path, parallel_engines_fixture, variant_fixture
from tests.engine.test_compression_checkpoint import to_bf16
from tests.engine.test_mechanics import make_engine
from tests.engine.test_moe import random_prompts
from tests.engine.test_parallel import Engines, assert_prompt_logits
from tests.engine.test_reference import engine_greedy

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

# Weights 5x the default scale, so that the attention moves the logits (see conftest's DeepSeek-V3); 8 routed
# experts in 2 groups, one group and 2 experts per token, one shared expert, a 2.5 routing scale
GLM = {**SMALL, "num_hidden_layers": 3, "head_dim": 32, "initializer_range": 0.1, "first_k_dense_replace": 1,
       "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1,
       "n_shared_experts": 1, "routed_scaling_factor": 2.5, "use_qk_norm": True, "attention_bias": True}
# GLM-4.5-Air's config spelling as published (rope_theta and partial_rotary_factor at the top level, rope_scaling
# null), here with a quarter of each head rotating
AIR_SPELLING = {"rope_scaling": None, "rope_theta": 500.0, "partial_rotary_factor": 0.25}


def _glm(**kw):
    return transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**{**GLM, **kw}))


VARIANTS = {
    # GLM-4.5 / 4.6's shape, small: q/k norms, q/k/v biases, grouped routing, renormalized weights
    "glm4.5": (lambda: _glm(), {}),
    # GLM-4.5-Air's without q/k norms, and here no biases, one group, 3 experts per token whose weights are not
    # renormalized, two shared experts
    "glm4.5-air": (lambda: _glm(use_qk_norm=False, attention_bias=False, n_group=1, topk_group=1,
                                num_experts_per_tok=3, norm_topk_prob=False, n_shared_experts=2), AIR_SPELLING),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "glm4.5",
                      "the decode paths differ in attention only, which one variant covers")


def test_config_reads_as_transformers_reads_it(variant):
    """Partial rotary at transformers' frequencies, q/k norms and biases as the config turns them on, one dense layer
    then MoE layers, and memory sizing counting every parameter (the routing bias buffer included)."""
    name, directory, reference = variant
    cfg = load_config(directory)
    their = reference.config
    assert cfg.rotary_dim == int(cfg.head_dim * their.rope_parameters["partial_rotary_factor"]) < cfg.head_dim
    torch.testing.assert_close(ops.rope_inv_freq(cfg.rotary_dim, cfg.rope, 64), reference.model.rotary_emb.inv_freq)
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.o_bias) == (their.use_qk_norm, their.attention_bias, False)
    assert cfg.moe.sparse_layers == [False, True, True]
    assert (cfg.moe.num_groups, cfg.moe.topk_groups, cfg.moe.num_shared_experts) == (
        their.n_group, their.topk_group, their.n_shared_experts)
    bias = sum(b.numel() for n, b in reference.named_buffers() if n.endswith("e_score_correction_bias"))
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters()) + bias


def test_model_info_reports_the_kv_bytes_of_its_decoder_layers(variant):
    """GetModelInfo's KV bytes per token: keys and values of the KV heads, every decoder layer (the stored
    multi-token-prediction layer holds none), in the engine's dtype."""
    from engine.demo import train_tokenizer
    from node_agent.models import _model_info

    name, directory, reference = variant
    if name != "glm4.5":
        pytest.skip("the same for every variant")
    train_tokenizer(320).save(str(directory / "tokenizer.json"))
    their = reference.config
    assert load_config(directory).num_nextn_layers == their.num_nextn_predict_layers == 1
    per_token = their.num_hidden_layers * 2 * their.num_key_value_heads * their.head_dim
    assert _model_info("glm", make_engine(directory)).kv_bytes_per_token == per_token * 4
    assert _model_info("glm", make_engine(directory, dtype="bfloat16")).kv_bytes_per_token == per_token * 2


def _with_mtp_layer(source: Path, directory: Path, num_nextn: int | None) -> None:
    """source's checkpoint plus a multi-token-prediction layer stored as the published checkpoints store it, after
    the decoder's; num_nextn: the config's num_nextn_predict_layers (None: the key left out)."""
    directory.mkdir()
    tensors = load_file(source / "model.safetensors")
    layer = "model.layers.3."
    for name, shape in (("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
                        ("shared_head.norm.weight", (64,)), ("self_attn.q_proj.weight", (128, 64))):
        tensors[layer + name] = torch.randn(shape)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((source / "config.json").read_text())
    raw.pop("num_nextn_predict_layers")
    if num_nextn is not None:
        raw["num_nextn_predict_layers"] = num_nextn
    (directory / "config.json").write_text(json.dumps(raw))


def test_a_stored_multi_token_prediction_layer_is_left_unread(variant, tmp_path):
    name, directory, reference = variant
    if name != "glm4.5":
        pytest.skip("the same for every variant")
    prompt = random_prompts([12], seed=3)[0]
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0]
    for num_nextn in (1, None):   # transformers' default: 1
        _with_mtp_layer(directory, tmp_path / f"mtp-{num_nextn}", num_nextn)
        ours = make_engine(tmp_path / f"mtp-{num_nextn}").prompt_logits(prompt)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    _with_mtp_layer(directory, tmp_path / "no-mtp", 0)
    with pytest.raises(CheckpointError, match="'model.layers.3.eh_proj.weight'"):
        make_engine(tmp_path / "no-mtp")


def test_a_compressed_copy_gives_the_logits_of_its_original_in_both_weight_modes(tmp_path):
    # compressed_in_memory streams the dense layer's MLP and expands the experts of the MoE layers
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, VARIANTS["glm4.5"][0], {})
    to_bf16(original)
    reference = transformers.AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    compress_checkpoint(original, compressed, chunk_size=64, show_progress=False, say=lambda *_: None)
    prompts = random_prompts([9, 20], seed=5)
    plain = make_engine(original, dtype="float32").prompt_logits(prompts[1])
    for mode in ("decompress_on_load", "compressed_in_memory"):
        engine = LLMEngine(compressed, EngineConfig(kv_cache_bytes=8 << 20, show_progress=False, dtype="float32",
                                                    max_num_batched_tokens=24, block_size=8, weight_mode=mode))
        assert torch.equal(engine.prompt_logits(prompts[1]), plain), mode
        for prompt, tokens in zip(prompts, engine_greedy(engine, prompts, 5)):
            with torch.no_grad():
                theirs = reference(torch.tensor([prompt + tokens[:-1]])).logits[0]
            assert theirs[len(prompt) - 1:].argmax(-1).tolist() == tokens, mode


parallel_engines = parallel_engines_fixture("glm4-moe-parallel", {"glm4.5": VARIANTS["glm4.5"][0]}, Engines)


@pytest.mark.parallel
@pytest.mark.parametrize("layout", [(2, 1, 2), (1, 1, 2)], ids=["tp2-ep2", "ep2"])
def test_parallel_logits_match_transformers(parallel_engines, layout):
    # tp=2: each rank 2 of the 4 query heads and 1 of the 2 KV heads (their biases' rows; q/k norms whole), half
    # the dense MLP, half the routed experts and the whole shared expert; ep=2: attention repeated, experts split
    assert_prompt_logits(parallel_engines, "glm4.5", layout, (1, 1, 1))


def _raw(**changes) -> dict:
    config = transformers.Glm4MoeConfig(**GLM).to_dict()
    config.update(changes)
    return config


ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("changes, error, message", [
    ({"rope_parameters": {**ROPE, "partial_rotary_factor": 1.5}}, CheckpointError,
     "partial_rotary_factor must be a number in (0, 1], got 1.5"),
    ({"rope_parameters": None, "partial_rotary_factor": 0}, CheckpointError,
     "partial_rotary_factor must be a number in (0, 1], got 0"),
    ({"rope_parameters": {**ROPE, "partial_rotary_factor": 0.03}}, UnsupportedModelError,
     "partial_rotary_factor 0.03 leaves 0 of the 32 head dims to rotate"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}}, UnsupportedModelError,
     "rope type 'longrope' is not supported for glm4_moe"),
    ({"n_group": 3}, CheckpointError, "n_group 3 must split the 8 routed experts into equal groups"),
    ({"topk_group": 3}, CheckpointError, "topk_group 3 exceeds n_group 2"),
    ({"num_experts_per_tok": 5}, CheckpointError, "num_experts_per_tok 5 exceeds the 4 experts"),
    ({"n_shared_experts": -1}, CheckpointError, "n_shared_experts must be a non-negative integer, got -1"),
    ({"routed_scaling_factor": 0}, CheckpointError, "routed_scaling_factor must be a positive number, got 0"),
    ({"first_k_dense_replace": "1"}, CheckpointError, "first_k_dense_replace must be a non-negative integer"),
    ({"use_qk_norm": "true"}, CheckpointError, "use_qk_norm must be true or false, got 'true'"),
    ({"attention_bias": 1}, CheckpointError, "attention_bias must be true or false, got 1"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
    ({"num_nextn_predict_layers": "1"}, CheckpointError, "num_nextn_predict_layers must be a positive integer"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    escaped = message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(error, match=escaped):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    raw = {"model_type": "glm4_moe", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    cfg = parse_config(raw, Path("config.json"))
    their = transformers.Glm4MoeConfig(**{key: value for key, value in raw.items() if key != "model_type"})
    assert cfg.rotary_dim == int(cfg.head_dim * their.rope_parameters["partial_rotary_factor"]) == 8
    assert (cfg.rope.theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        their.rope_parameters["rope_theta"], their.rms_norm_eps, their.max_position_embeddings)
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.o_bias, cfg.tie_word_embeddings) == (False, False, False, False)
    moe = cfg.moe
    assert moe.sparse_layers == [i >= their.first_k_dense_replace for i in range(4)]
    assert (moe.num_groups, moe.topk_groups, moe.num_shared_experts, moe.routed_scaling_factor, moe.norm_topk_prob) \
        == (their.n_group, their.topk_group, their.n_shared_experts, their.routed_scaling_factor, their.norm_topk_prob)
    assert cfg.num_nextn_layers == their.num_nextn_predict_layers


def test_yarn_on_the_rotary_part_is_what_transformers_computes():
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "partial_rotary_factor": 0.5}
    raw = _raw(rope_parameters=rope, max_position_embeddings=512)
    cfg = parse_config(raw, Path("config.json"))
    rotary = transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeRotaryEmbedding(
        transformers.Glm4MoeConfig(**{key: value for key, value in raw.items() if key != "model_type"}))
    assert cfg.rotary_dim == 16
    torch.testing.assert_close(ops.rope_inv_freq(cfg.rotary_dim, cfg.rope, 512), rotary.inv_freq)
    assert cfg.rope.attention_factor == pytest.approx(rotary.attention_scaling)
