"""Llama 4 checkpoints (Scout 17B-16E, Maverick 17B-128E): the engine computes what transformers computes on the same
random-weight checkpoint, text-only (llama4_text) and image-and-text (llama4, served as its text model).

What is Llama 4's own, each shaping the logits here: rotary as a complex multiplication of interleaved pairs (the
loader reorders q's and k's rows to the halves the engine rotates), llama3 rope scaling; NoPE layers whose queries
are scaled by a temperature that grows with the position (floor_scale small enough that it changes within the
prompts); on the rotary layers a weightless norm of q and k and chunked attention (chunks of 6, shorter than the
prompts and not a multiple of the 8-token blocks); mixture-of-experts layers (every layer, or every other) whose
chosen experts take their input times the sigmoid of their router logit, beside a shared expert, stored stacked and
transposed. Prompts are chunked and batched beside decode rows, on the C decode loop and on the torch path; one
checkpoint also runs at tp=2 with ep=2, from its compressed copy, and on the Triton kernels.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import moe, ops
from engine.config import load_config, parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from engine.sampling import SamplingParams
from tests.engine.conftest import _randomize, save_random_checkpoint
from tests.engine.family_checks import DECODE_PATHS, check_compressed_copy, check_decode_path, variant_fixture
from tests.engine.test_moe import check_against_transformers, random_prompts
from tests.engine.test_parallel import PROMPT, Engines, assert_prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK = 6
LLAMA4 = dict(vocab_size=320, hidden_size=64, intermediate_size=48, intermediate_size_mlp=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
              attention_chunk_size=CHUNK, no_rope_layer_interval=2, floor_scale=4, attn_scale=0.5,
              max_position_embeddings=128, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
              rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16, "rope_theta": 500.0})
VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
              patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64)


def _llama4(**kw):
    return transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**{**LLAMA4, **kw}))


def _llama4_image_text():
    config = transformers.Llama4Config(text_config={**LLAMA4, "num_hidden_layers": 2, "interleave_moe_layer_step": 2},
                                       vision_config=VISION)
    return transformers.Llama4ForConditionalGeneration(config)


VARIANTS = {
    # Scout's shape: every layer MoE, q/k norms, llama3 rope; the saved no_rope_layers, layer_types and moe_layers
    # removed, so the engine derives them from the intervals as transformers does
    "scout": (lambda: _llama4(), {"no_rope_layers": None, "layer_types": None, "moe_layers": None}),
    # Maverick's: MoE and dense layers in turn, no q/k norms, unscaled rope; here also two experts a token and biases
    "maverick": (lambda: _llama4(interleave_moe_layer_step=2, use_qk_norm=False, num_experts_per_tok=2,
                                 attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
                 {}),
}


def _save(directory: Path, name: str):
    factory, edits = VARIANTS[name]
    return save_random_checkpoint(directory, factory, edits)


variant = variant_fixture(VARIANTS)


@DECODE_PATHS
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    check_decode_path(variant, decode_in_c, monkeypatch, "scout",
                      "decode attention differs between the paths only in its window")


def test_the_layers_are_what_transformers_reads(variant):
    name, directory, reference = variant
    cfg = load_config(directory)
    config = reference.config
    assert cfg.nope_layers == [not rotates for rotates in config.no_rope_layers] == [False, True, False, True]
    assert cfg.sliding_windows == [-CHUNK if kind == "chunked_attention" else None for kind in config.layer_types]
    assert cfg.l2_qk_norm_layers == [config.use_qk_norm and bool(rotates) for rotates in config.no_rope_layers]
    assert cfg.moe.sparse_layers == [i in config.moe_layers for i in range(4)]
    assert cfg.num_parameters() == sum(p.numel() for p in reference.parameters())
    torch.testing.assert_close(ops.rope_inv_freq(cfg.head_dim, cfg.rope, 128), reference.model.rotary_emb.inv_freq)


# -- each of Llama 4's features shapes the logits --------------------------------------------------------------


def _without_chunks(engine):
    engine.model.sliding_windows = [None] * len(engine.model.sliding_windows)


def _without_temperature(engine):
    engine.model.config.attn_temperature = None


def _without_qk_norm(engine):
    engine.model.l2_qk_norms = [None] * len(engine.model.l2_qk_norms)


def _weighing_outputs(engine, monkeypatch):
    # the sigmoids weigh the experts' outputs instead of their inputs
    monkeypatch.setattr(moe, "run_experts_on_weighted_inputs",
                        lambda block, x, weights, ids, kernel_ops: moe.run_experts(block, x, weights, ids, kernel_ops))


@pytest.mark.parametrize("drop", [_without_chunks, _without_temperature, _without_qk_norm, _weighing_outputs],
                         ids=["chunks", "temperature", "qk-norm", "input-weighing"])
def test_each_feature_moves_the_logits_past_the_tolerance(tmp_path, drop, monkeypatch):
    directory = tmp_path / "scout"
    reference = _save(directory, "scout")
    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, block_size=8))
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(engine.prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)
    drop(engine, monkeypatch) if drop is _weighing_outputs else drop(engine)
    assert (engine.prompt_logits(PROMPT) - theirs).abs().max() > 0.1


# -- the image-and-text checkpoint, a compressed copy, tensor and expert parallelism, the kernels -------------------


def test_an_image_and_text_checkpoint_serves_its_text_model(tmp_path):
    torch.manual_seed(1234)
    model = _llama4_image_text().eval()
    _randomize(model)
    model.save_pretrained(tmp_path)
    model = transformers.Llama4ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    cfg = load_config(tmp_path)
    assert cfg.image_text_checkpoint and cfg.model_type == "llama4_text" and cfg.sliding_windows == [-CHUNK, None]
    # on text alone its forward is its language model's on the embedded ids, which is what is called here: transformers
    # 5.24's own forward fails to build its output (it reads image_outputs from the language model's)
    assert model.get_input_embeddings() is model.language_model.get_input_embeddings()
    check_against_transformers(tmp_path, model.language_model, random_prompts([9, 20], seed=5), max_tokens=4)


def test_a_compressed_checkpoint_gives_the_original_logits_in_both_weight_modes(tmp_path):
    original, compressed = tmp_path / "bf16", tmp_path / "compressed"
    _save(original, "maverick")
    check_compressed_copy(original, compressed)


class _Llama4Engines(Engines):
    def adjust(self, name: str, model: torch.nn.Module) -> None:
        _randomize(model)


@pytest.mark.parallel
def test_tensor_and_expert_parallel_logits_match_transformers(tmp_path_factory):
    # tp=2 splits the 4 heads and 2 KV heads (q/k rows reordered per rank's heads); ep=2 puts 2 of the 4 experts on
    # each rank, which take their rows already weighed
    engines = _Llama4Engines(tmp_path_factory.mktemp("llama4-parallel"), {"maverick": VARIANTS["maverick"][0]})
    try:
        assert_prompt_logits(engines, "maverick", (2, 1, 2), (1, 1, 1))
        assert engines.get("maverick", (2, 1, 2)).model.weights.layers[1].moe.gate_up.shape[0] == 2
    finally:
        engines.close()


def test_the_kernels_compute_what_the_torch_ops_compute(tmp_path):
    """Chunked prefill and decode attention, the weightless norms and the input-weighed experts on the Triton kernels
    (under the interpreter without a GPU), against the engine on the torch ops."""
    pytest.importorskip("triton")
    from engine import kernels
    from engine.kernels import ops as kernel_ops
    if not torch.cuda.is_available() and not kernels.interpreting():
        pytest.skip("no GPU, and triton's interpreter was not chosen before triton was imported")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    save_random_checkpoint(tmp_path, lambda: _llama4(num_hidden_layers=2), {})
    config = EngineConfig(device=device, dtype="float32", kv_cache_bytes=1 << 20, block_size=4, show_progress=False)
    prompt, params = PROMPT[:14], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    results = []
    for use_kernels in (True, False):
        engine = LLMEngine(tmp_path, config)
        if use_kernels:
            engine.model.ops = kernel_ops
        engine.add_request("a", prompt, params)
        tokens = []
        while engine.has_work():
            tokens += [out.token.token_id for out in engine.step()]
        results.append((engine.prompt_logits(prompt).cpu(), tokens))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-4, atol=1e-4)
    assert results[0][1] == results[1][1]


# -- configs -----------------------------------------------------------------------------------------------------


def _raw(**changes) -> dict:
    config = transformers.Llama4TextConfig(**LLAMA4).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"attention_chunk_size": 0}, CheckpointError, "attention_chunk_size must be a positive integer"),
    ({"attention_chunk_size": None}, CheckpointError, "attention_chunk_size is null"),
    ({"layer_types": ["sliding_attention"] * 4}, CheckpointError, "layer_types must list one of"),
    ({"no_rope_layers": [1, 0, 2, 1]}, CheckpointError, "no_rope_layers must list 1 (rotary) or 0"),
    ({"floor_scale": 0}, CheckpointError, "floor_scale must be a positive number"),
    ({"attn_scale": -0.1}, CheckpointError, "attn_scale must be a number >= 0"),
    ({"attn_temperature_tuning": "yes"}, CheckpointError, "attn_temperature_tuning must be true or false"),
    ({"use_qk_norm": 1}, CheckpointError, "use_qk_norm must be true or false"),
    ({"moe_layers": [1, 4]}, CheckpointError, "moe_layers must list layer indices in [0, 4)"),
    ({"num_experts_per_tok": 5}, CheckpointError, "num_experts_per_tok 5 exceeds the 4 experts"),
    ({"intermediate_size_mlp": 0}, CheckpointError, "intermediate_size_mlp must be a positive integer"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu' is not supported"),
])
def test_llama4_configs_the_engine_cannot_follow_are_refused_naming_the_key(changes, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_config(_raw(**changes), Path("config.json"))


@pytest.mark.parametrize("published, meaning", [(4, True), (0, False)])
def test_a_numeric_attn_temperature_tuning_reads_as_its_truth_value(published, meaning):
    # Scout's and Maverick's published configs (and fine-tunes of them) say 4: transformers wrote that default then
    # and read the key as a truth value
    reference = transformers.Llama4TextConfig(**LLAMA4, attn_temperature_tuning=meaning)
    cfg = parse_config(_raw(attn_temperature_tuning=published), Path("config.json"))
    assert cfg.attn_temperature == ((reference.floor_scale, reference.attn_scale) if meaning else None)


def test_omitted_fields_default_as_transformers_defaults_them():
    raw = {"model_type": "llama4_text", "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 8,
           "num_attention_heads": 4, "num_key_value_heads": 2}
    cfg = parse_config(raw, Path("config.json"))
    reference = transformers.Llama4TextConfig(**{key: value for key, value in raw.items() if key != "model_type"})
    assert cfg.head_dim == reference.head_dim == 128
    assert cfg.nope_layers == [not rotates for rotates in reference.no_rope_layers]
    assert cfg.sliding_windows == [-8192 if kind == "chunked_attention" else None for kind in reference.layer_types]
    assert cfg.attn_temperature == (reference.floor_scale, reference.attn_scale)
    assert cfg.moe.sparse_layers == [i in reference.moe_layers for i in range(8)]
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.intermediate_size, cfg.intermediate_size) == (
        reference.num_local_experts, reference.num_experts_per_tok, reference.intermediate_size,
        reference.intermediate_size_mlp)
    assert cfg.rope.theta == reference.rope_parameters["rope_theta"] and cfg.rms_norm_eps == reference.rms_norm_eps
    assert cfg.eos_token_ids == [reference.eos_token_id] and not cfg.tie_word_embeddings
