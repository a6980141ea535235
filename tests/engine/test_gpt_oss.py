"""gpt-oss checkpoints: the engine computes what transformers computes on the same random-weight checkpoint.

gpt-oss's attention carries biases and a learned sink per head (one more logit in each softmax's
denominator), alternates sliding-window and full-attention layers, and rotates by yarn; its experts are
stored fused, transposed and with gate and up columns alternating, carry biases, are chosen by a biased
router (softmax over the top-k logits) and activate by a clamped SwiGLU, here with a limit low enough
that the clamps bite. Every prompt but the shortest is longer than the window; prompts are chunked and
batched beside decode rows, on the C decode loop and on the torch path. The released checkpoints store
the experts in MXFP4: a checkpoint quantized here by the format's definition loads to the logits
transformers computes from it. Experts split over two ranks (expert parallelism, with and without
tensor parallelism) give the single-process logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import cpu_attention, mxfp4, ops
from engine.config import parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.test_compression_checkpoint import to_bf16
from tests.engine.test_moe import check_against_transformers, random_prompts
from tests.engine.test_parallel import Engines, assert_prompt_logits

transformers = pytest.importorskip("transformers")

WINDOW = 6   # shorter than all prompts but the first, and not a multiple of the 8-token blocks
GPT_OSS = dict(vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
               max_position_embeddings=128, initializer_range=0.1, swiglu_limit=0.5,
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 1000.0})
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def _gpt_oss(**kw):
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**GPT_OSS, **kw}))


def _randomize(model) -> None:
    # sinks large enough to take a visible share of each softmax; norms and biases away from 1 and 0; routers'
    # logits far apart, so float rounding never flips a token's top-k
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn_like(param))
            elif name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif name.endswith("router.weight"):
                param.copy_(0.5 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))


def _reference(directory: Path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()


def _save(directory: Path, **kw):
    torch.manual_seed(1234)
    model = _gpt_oss(**kw).eval()
    _randomize(model)
    model.save_pretrained(directory)
    return _reference(directory)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt-oss")
    return directory, _save(directory)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """The checkpoint with every tensor in bfloat16, as the released non-quantized weights are."""
    directory = tmp_path_factory.mktemp("gpt-oss-bf16")
    _save(directory)
    to_bf16(directory)
    return directory, _reference(directory)


@pytest.mark.parametrize("decode_in_c", [True, False], ids=["c-decode", "torch-decode"])
def test_logits_and_greedy_tokens_match_transformers(checkpoint, decode_in_c, monkeypatch):
    directory, reference = checkpoint
    if not decode_in_c:
        monkeypatch.setattr(cpu_attention, "supports", lambda *args: False)
    elif not cpu_attention.available():
        pytest.skip("the C decode attention is not built")
    check_against_transformers(directory, reference, random_prompts([3, 9, 20, 41], seed=11), max_tokens=6)


def test_a_bfloat16_checkpoint_matches_transformers(bf16_checkpoint):
    directory, reference = bf16_checkpoint
    check_against_transformers(directory, reference, random_prompts([5, 30], seed=3), max_tokens=5)


def test_the_clamps_and_the_sinks_shape_the_output(checkpoint):
    """The checkpoint exercises what is gpt-oss's own: without its sinks, or with the SwiGLU unclamped,
    transformers' own logits move."""
    directory, reference = checkpoint
    prompt = torch.tensor(random_prompts([20], seed=4))
    with torch.no_grad():
        logits = reference(prompt).logits
        for layer in reference.model.layers:
            layer.mlp.experts.limit = 1e9
        unclamped = reference(prompt).logits
        for layer in reference.model.layers:
            layer.mlp.experts.limit = GPT_OSS["swiglu_limit"]
            layer.self_attn.sinks.sub_(100.0)
        sinkless = reference(prompt).logits
        for layer in reference.model.layers:
            layer.self_attn.sinks.add_(100.0)
    assert (logits - unclamped).abs().max() > 1e-2
    assert (logits - sinkless).abs().max() > 1e-2


def test_rope_and_windows_are_what_transformers_reads(checkpoint):
    directory, reference = checkpoint
    cfg = parse_config(json.loads((directory / "config.json").read_text()), directory / "config.json")
    assert reference.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert cfg.sliding_windows == [WINDOW, None, WINDOW]
    rotary = reference.model.rotary_emb
    torch.testing.assert_close(ops.rope_inv_freq(cfg.head_dim, cfg.rope, 128), rotary.inv_freq)
    assert cfg.rope.attention_factor == pytest.approx(rotary.attention_scaling)


# -- MXFP4 ----------------------------------------------------------------------------------------------


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., cols] in MXFP4 by the format's definition: (blocks uint8 [..., cols / 32, 16], scales uint8
    [..., cols / 32]); each block's scale the power of two that brings its largest magnitude within 6 (the
    largest E2M1 value), each value rounded to the nearest E2M1 one, two codes a byte, low nibble first."""
    grouped = weight.float().reshape(*weight.shape[:-1], -1, 32)
    largest = grouped.abs().amax(dim=-1).clamp(min=2.0 ** -100)
    exponent = torch.ceil(torch.log2(largest / 6.0))
    scaled = grouped / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(mxfp4.E2M1_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1) | ((scaled < 0).long() << 3)
    pairs = codes.reshape(*codes.shape[:-1], 16, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8), (exponent + 127).to(torch.uint8)


def _write_mxfp4(source: Path, target: Path) -> None:
    """source's checkpoint with its experts in MXFP4, under the released checkpoints' names and layout (rows of
    the output dim, blocks along the input) and quantization_config."""
    target.mkdir()
    tensors = load_file(source / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _quantize(tensors.pop(name).transpose(1, 2))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((source / "config.json").read_text())
    raw["quantization_config"] = MXFP4_CONFIG
    (target / "config.json").write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def mxfp4_checkpoint(bf16_checkpoint, tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt-oss-mxfp4") / "model"
    _write_mxfp4(bf16_checkpoint[0], directory)
    return directory


def test_dequantization_is_transformers_and_the_format_definition():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 5, 4), dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales, torch.bfloat16)
    # transformers returns the transposed weight [E, cols, rows]
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).transpose(1, 2))
    # by hand: byte 0x9a of block 0 holds -1.0 (code 0xa) then -0.5 (code 0x9), times 2^(scale - 127)
    one = mxfp4.dequantize(torch.tensor([[0x9A] + [0x70] * 15], dtype=torch.uint8),
                           torch.tensor([129], dtype=torch.uint8), torch.float32)
    assert one[:4].tolist() == [-4.0, -2.0, 0.0, 24.0]


def test_an_mxfp4_checkpoint_loads_to_transformers_logits(mxfp4_checkpoint):
    reference = _reference(mxfp4_checkpoint, quantization_config=transformers.Mxfp4Config(dequantize=True))
    check_against_transformers(mxfp4_checkpoint, reference, random_prompts([7, 26], seed=9), max_tokens=5)


def test_mxfp4_is_really_what_was_loaded(mxfp4_checkpoint, bf16_checkpoint):
    """The quantized experts differ from the bf16 ones (else the test above proves nothing about MXFP4)."""
    config = EngineConfig(kv_cache_bytes=1 << 20, show_progress=False)
    quantized = LLMEngine(mxfp4_checkpoint, config).model.weights.layers[0].moe
    plain = LLMEngine(bf16_checkpoint[0], config).model.weights.layers[0].moe
    assert quantized.gate_up.shape == plain.gate_up.shape == (8, 128, 64)
    assert not torch.equal(quantized.gate_up, plain.gate_up)
    torch.testing.assert_close(quantized.gate_up, plain.gate_up, rtol=0.3, atol=0.05)


def test_an_mxfp4_checkpoint_missing_its_scales_is_refused(mxfp4_checkpoint, tmp_path):
    tensors = load_file(mxfp4_checkpoint / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((mxfp4_checkpoint / "config.json").read_text())
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.experts.down_proj_scales'"):
        LLMEngine(tmp_path, EngineConfig(kv_cache_bytes=1 << 20, show_progress=False))


# -- configs ----------------------------------------------------------------------------------------------


def _raw(**changes) -> dict:
    config = transformers.GptOssConfig(**GPT_OSS).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"quantization_config": {"quant_method": "fp8"}}, UnsupportedModelError, "quantization_config names 'fp8'"),
    ({"layer_types": ["sliding_attention"] * 2}, CheckpointError, "layer_types must list one of"),
    ({"num_experts_per_tok": 9}, CheckpointError, "num_experts_per_tok 9 exceeds the 8 experts"),
    ({"swiglu_limit": 0}, CheckpointError, "swiglu_limit must be a positive number"),
])
def test_gpt_oss_configs_the_engine_cannot_follow_are_refused_naming_the_key(changes, error, message):
    with pytest.raises(error, match=message):
        parse_config(_raw(**changes), Path("config.json"))


def test_mxfp4_is_accepted_for_gpt_oss_only():
    parse_config(_raw(quantization_config=MXFP4_CONFIG), Path("config.json"))
    llama = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4).to_dict()
    with pytest.raises(UnsupportedModelError, match="quantization_config names 'mxfp4'"):
        parse_config({**llama, "quantization_config": MXFP4_CONFIG}, Path("config.json"))


def test_omitted_fields_default_as_transformers_defaults_them():
    raw = {"model_type": "gpt_oss", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
    cfg = parse_config(raw, Path("config.json"))
    reference = transformers.GptOssConfig(**{key: value for key, value in raw.items() if key != "model_type"})
    assert cfg.head_dim == reference.head_dim == 64
    assert cfg.sliding_windows == [128, None, 128, None]
    assert cfg.qkv_bias and cfg.o_bias and cfg.attention_sinks
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor, cfg.rope.truncate) == ("yarn", 150000.0, 32.0, False)
    assert cfg.moe.num_experts == reference.num_local_experts and cfg.moe.swiglu == (1.702, 7.0)
    assert cfg.rms_norm_eps == reference.rms_norm_eps


# -- expert and tensor parallelism ------------------------------------------------------------------------


class _GptOssEngines(Engines):
    def adjust(self, name: str, model: torch.nn.Module) -> None:
        _randomize(model)


@pytest.fixture(scope="module")
def parallel_engines(tmp_path_factory):
    made = _GptOssEngines(tmp_path_factory.mktemp("gpt-oss-parallel"), {"gpt-oss": _gpt_oss})
    yield made
    made.close()


@pytest.mark.parallel
@pytest.mark.parametrize("layout", [(1, 1, 2), (2, 1, 2)], ids=["ep2", "tp2-ep2"])
def test_expert_and_tensor_parallel_logits_match_transformers(parallel_engines, layout):
    # ep=2: 4 of the 8 experts (their biases with them) on each rank; tp=2 also splits the 4 heads, their sinks too
    assert_prompt_logits(parallel_engines, "gpt-oss", layout, (1, 1, 1))
    layer = parallel_engines.get("gpt-oss", layout).model.weights.layers[0]
    assert layer.moe.gate_up.shape[0] == layer.moe.gate_up_bias.shape[0] == layer.moe.down_bias.shape[0] == 4
    assert layer.sinks.shape == (4 // layout[0],)


def test_resident_weight_count_is_every_parameter_transformers_builds(checkpoint):
    """Memory sizing counts the sinks, the router's bias and every expert's biases (all resident)."""
    from engine.config import load_config

    directory, reference = checkpoint
    assert load_config(directory).num_parameters() == sum(p.numel() for p in reference.parameters())


def test_the_released_config_spelling_reads_as_transformers_reads_it():
    """gpt-oss-20b's config.json as released: rope_theta and rope_scaling at the top level, experts_per_token beside
    num_experts_per_tok, MXFP4 experts."""
    raw = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
           "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
           "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
           "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
           "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
           "pad_token_id": 199999, "quantization_config": MXFP4_CONFIG, "rms_norm_eps": 1e-05,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "rope_type": "yarn",
                            "original_max_position_embeddings": 4096, "truncate": False},
           "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
           "vocab_size": 201088}
    cfg = parse_config(raw, Path("config.json"))
    reference = transformers.GptOssConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    rotary = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(reference)
    torch.testing.assert_close(ops.rope_inv_freq(cfg.head_dim, cfg.rope, 131072), rotary.inv_freq)
    assert cfg.rope.attention_factor == pytest.approx(rotary.attention_scaling)
    assert cfg.sliding_windows == [128, None] * 12
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.intermediate_size) == (32, 4, 2880)
    assert cfg.eos_token_ids == [200002]
