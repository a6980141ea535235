"""dots.llm1 checkpoints (`dots1`: dots.llm1.base, .inst): the engine computes what transformers computes on the same
random-weight checkpoint, read from the same config.json.

dots.llm1 is Qwen3's attention (q and k RMS-normed over each head before the rotary, q/k/v/o biased by
attention_bias) with DeepSeek-V3's layers: the first first_k_dense_replace dense, the others experts chosen by sigmoid
scores plus a correction bias among the best groups, weighted by those scores (renormalized by norm_topk_prob, times
routed_scaling_factor), beside n_shared_experts shared experts. Its layers from max_window_layers on (or those
layer_types marks) attend a window when sliding_window is set. One variant is dots.llm1.inst's published config shrunk;
prompts are chunked and batched beside decode rows, on the C decode loop and on the torch path, and also run at tp=2 +
ep=2 and from a compressed copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from engine.config import load_config, parse_config
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import save_random_checkpoint
from tests.engine.family_checks import (DECODE_PATHS, assert_shape_as_transformers, check_compressed_copy,
                                        check_decode_path, parallel_engines_fixture, variant_fixture)
from tests.engine.test_parallel import assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# dots.llm1.inst's config.json as third-party ports quote it (rednote-hilab/dots.llm1.inst, mirrored in an MLX
# conversion's tests); its n_group and topk_group are reported null, here left out as those ports left them
PUBLISHED = {"model_type": "dots1", "hidden_size": 4096, "num_hidden_layers": 62, "intermediate_size": 10944,
             "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-05, "vocab_size": 152064,
             "first_k_dense_replace": 1, "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 2,
             "num_experts_per_tok": 6, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
             "max_position_embeddings": 32768, "rope_theta": 10000000, "scoring_func": "sigmoid",
             "attention_bias": False, "tie_word_embeddings": False, "eos_token_id": 151649}
# ... shrunk, every other key kept: 8 experts of 32, top-3, 4 heads of 16 (MHA as published); weights 5x the default
# scale so that the attention moves the logits (see conftest's DeepSeek-V3)
SHRUNK = {"hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 4, "vocab_size": 320, "moe_intermediate_size": 32, "n_routed_experts": 8,
          "num_experts_per_tok": 3, "max_position_embeddings": 512, "eos_token_id": 2, "initializer_range": 0.1}
TINY = {key: value for key, value in {**PUBLISHED, **SHRUNK}.items() if key not in ("model_type", "scoring_func")}
WINDOW = 6   # shorter than all prompts but the first, and not a multiple of the 8-token blocks


def _dots1(**kw):
    return transformers.Dots1ForCausalLM(transformers.Dots1Config(**{**TINY, **kw}))


VARIANTS = {
    # dots.llm1.inst's shape, small: one dense layer then two sparse ones, one group, renormalized top-3 scaled by 2.5,
    # two shared experts, a large rope base; its published routing key kept
    "dots.llm1": (_dots1, {"scoring_func": "sigmoid"}),
    # 8 experts in 4 groups, 2 groups a token, transformers' unrenormalized and unscaled weights, GQA, every projection
    # biased, and layers 1 and 2 attending a window of WINDOW (max_window_layers 1)
    "dots1-groups-window": (lambda: _dots1(n_group=4, topk_group=2, num_key_value_heads=2, norm_topk_prob=False,
                                           routed_scaling_factor=1.0, attention_bias=True, sliding_window=WINDOW,
                                           max_window_layers=1, rope_theta=10000.0), {}),
}


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "dots1-groups-window",
                      "the decode paths differ in attention only, which one variant covers with its windows")


def test_config_is_what_transformers_reads(variant):
    """Per-head q/k norms, biases, dense and sparse layers, grouped routing and windows as transformers builds them, and
    memory sizing counting every parameter (the routing bias buffers included)."""
    name, directory, reference = variant
    cfg, their = load_config(directory), reference.config
    attention = reference.model.layers[0].self_attn
    assert cfg.qk_norm and attention.q_norm.weight.numel() == cfg.head_dim == 16
    assert (cfg.qkv_bias, cfg.o_bias) == (attention.q_proj.bias is not None, attention.o_proj.bias is not None)
    moe = cfg.moe
    sparse = [hasattr(layer.mlp, "experts") for layer in reference.model.layers]
    assert moe.sparse_layers == sparse == [False, True, True]
    assert (moe.num_groups, moe.topk_groups, moe.num_experts_per_tok, moe.norm_topk_prob, moe.routed_scaling_factor,
            moe.num_shared_experts, moe.scoring) == (their.n_group, their.topk_group, their.num_experts_per_tok,
                                                     their.norm_topk_prob, their.routed_scaling_factor,
                                                     their.n_shared_experts, "sigmoid")
    windows = [layer.self_attn.sliding_window for layer in reference.model.layers]
    assert cfg.sliding_windows == windows and any(windows) == (name == "dots1-groups-window")
    bias = sum(b.numel() for n, b in reference.named_buffers() if n.endswith("e_score_correction_bias"))
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters()) + bias


def test_the_published_tensor_names_load(variant):
    # transformers saves them as published: one tensor per expert projection, the correction bias under the router
    name, directory, reference = variant
    names = load_file(directory / "model.safetensors").keys()
    assert {"model.layers.1.mlp.experts.7.up_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.0.mlp.gate_proj.weight"} <= names


def test_the_published_config_reads_as_transformers_reads_it():
    """dots.llm1.inst's config (null groups read as one, as other runtimes read it; transformers cannot route so)."""
    raw = {**PUBLISHED, "n_group": None, "topk_group": None}
    cfg = parse_config(raw, Path("config.json"))
    their = transformers.Dots1Config(**{key: value for key, value in PUBLISHED.items()
                                        if key not in ("model_type", "scoring_func")})
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (
        their.hidden_size, their.num_hidden_layers, their.num_attention_heads, their.num_key_value_heads, 128,
        their.vocab_size)
    assert (cfg.rope.theta, cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.eos_token_ids, cfg.tie_word_embeddings) \
        == (their.rope_parameters["rope_theta"], their.rms_norm_eps, their.max_position_embeddings,
            [their.eos_token_id], False)
    moe = cfg.moe
    assert moe.sparse_layers == [i >= their.first_k_dense_replace for i in range(62)]
    assert (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size, moe.shared_width, moe.num_groups,
            moe.topk_groups, moe.norm_topk_prob, moe.routed_scaling_factor) == (
        their.n_routed_experts, their.num_experts_per_tok, their.moe_intermediate_size,
        their.n_shared_experts * their.moe_intermediate_size, 1, 1, True, their.routed_scaling_factor)
    assert cfg.sliding_windows == [None] * 62 == [None if kind == "full_attention" else kind
                                                   for kind in their.layer_types]


def test_scoring_func_noaux_tc_reads_as_the_sigmoid_routing_transformers_runs():
    """GGUF converters written against the published dots.llm1 checkpoints require scoring_func "noaux_tc" (the
    topk_method's name); transformers never reads the key and routes by sigmoid scores, so the engine serves such a
    config as it serves "sigmoid" instead of refusing it."""
    raw = _raw(scoring_func="noaux_tc", topk_method="noaux_tc")
    cfg = parse_config(raw, Path("config.json"))
    assert cfg.moe.scoring == "sigmoid"
    assert cfg == parse_config({**raw, "scoring_func": "sigmoid"}, Path("config.json"))


def test_a_compressed_copy_gives_the_logits_of_its_original(tmp_path):
    # compressed_in_memory streams the dense layer's MLP and expands the experts of the MoE layers
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    save_random_checkpoint(original, *VARIANTS["dots.llm1"])
    check_compressed_copy(original, compressed, weight_modes=("compressed_in_memory",))


parallel_engines = parallel_engines_fixture("dots1-parallel", VARIANTS)


@pytest.mark.parallel
def test_tensor_and_expert_parallel_logits_match_transformers(parallel_engines):
    # tp=2 + ep=2: each rank 2 of the 4 query heads and 1 of the 2 KV heads with their bias rows (q/k norms whole), half
    # the dense MLP and of the routed experts, the router and the shared experts whole
    assert_prompt_logits(parallel_engines, "dots1-groups-window", (2, 1, 2), (1, 1, 1))


def _raw(**changes) -> dict:
    config = transformers.Dots1Config(**TINY).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"scoring_func": "softmax"}, UnsupportedModelError, "scoring_func 'softmax' is not supported"),
    ({"n_group": 3}, CheckpointError, "n_group 3 must split the 8 routed experts into equal groups"),
    ({"n_group": 2, "topk_group": 3}, CheckpointError, "topk_group 3 exceeds n_group 2"),
    ({"num_experts_per_tok": 9}, CheckpointError, "num_experts_per_tok 9 exceeds the 8 experts"),
    ({"n_shared_experts": -1}, CheckpointError, "n_shared_experts must be a non-negative integer, got -1"),
    ({"first_k_dense_replace": "1"}, CheckpointError, "first_k_dense_replace must be a non-negative integer"),
    ({"n_routed_experts": None}, CheckpointError, "missing required field 'n_routed_experts'"),
    ({"sliding_window": WINDOW, "layer_types": None, "max_window_layers": None}, CheckpointError,
     "max_window_layers must be a non-negative integer, got None"),
    ({"sliding_window": None, "layer_types": ["full_attention", "sliding_attention", "full_attention"]},
     CheckpointError, "sliding_window is null but layer_types marks sliding_attention layers"),
    ({"layer_types": ["full_attention"] * 2}, CheckpointError, r"layer_types must list one of .* per layer \(3\)"),
    ({"attention_bias": 1}, CheckpointError, "attention_bias must be true or false, got 1"),
])
def test_configs_the_engine_cannot_follow_are_refused_naming_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    # transformers gives no count of routed or shared experts, nor a top-k: those the config must give
    raw = {"model_type": "dots1", "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2}
    cfg = parse_config(raw, Path("config.json"))
    their = transformers.Dots1Config(**{key: value for key, value in raw.items() if key != "model_type"})
    assert_shape_as_transformers(cfg, their, 144)
    assert (cfg.rope.theta, cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.tie_word_embeddings, cfg.bos_token_id,
            cfg.eos_token_ids) == (their.rope_parameters["rope_theta"], their.rms_norm_eps,
                                   their.max_position_embeddings, False, None, [])
    assert (cfg.qkv_bias, cfg.o_bias) == (False, False)
    # sliding_window 4096 from max_window_layers 62 on: no layer of 62
    assert cfg.sliding_windows == [None] * 62 == [None if kind == "full_attention" else kind
                                                   for kind in their.layer_types]
    moe = cfg.moe
    assert moe.sparse_layers == [i >= their.first_k_dense_replace for i in range(62)] == [True] * 62
    assert (moe.intermediate_size, moe.num_groups, moe.topk_groups, moe.norm_topk_prob, moe.routed_scaling_factor) == (
        their.moe_intermediate_size, their.n_group, their.topk_group, their.norm_topk_prob,
        their.routed_scaling_factor)
