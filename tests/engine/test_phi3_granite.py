"""Phi-3 (Phi-3/3.5/4-mini, Phi-4) and Granite 3.x checkpoints: the engine computes what transformers
computes on the same random-weight checkpoint, read from the same config.json.

Phi-3 stores q/k/v and gate/up fused (qkv_proj, gate_up_proj), may rotate only part of each head
(partial_rotary_factor) and scales its rope by longrope; Granite scales the embeddings, the softmax,
each block's output and the logits. Each variant runs a batch of prompts of different lengths through
the paged engine (chunked prefill beside decode rows), on the C decode loop and on the torch path,
and its logits and greedy tokens are compared with transformers'. One checkpoint also runs at tp=2,
where each rank takes its heads' rows of the fused qkv_proj and its share of gate_up_proj. A longrope
model rotates by the factors of the context it is served with: short_factor within the original context
(as transformers, for every sequence), long_factor past it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import cpu_attention
from engine.config import parse_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, UnsupportedModelError
from tests.engine.conftest import SMALL, save_random_checkpoint
from tests.engine.test_moe import check_against_transformers, greedy_with_logits, random_prompts
from tests.engine.test_parallel import Engines, assert_prompt_logits

transformers = pytest.importorskip("transformers")

# Weights 5x the default scale, so the attention moves the logits enough for a wrong softmax scale or
# rotation to show (at 0.02 Granite's logits barely saw its attention_multiplier)
WIDE = {**SMALL, "initializer_range": 0.1}
PHI3 = {**WIDE, "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
ROTARY_DIM = 12   # 0.75 of the 16-dim heads
ORIGINAL = 16     # the longrope checkpoints' "trained" context


def _factors(seed: int, low: float, high: float, count: int = ROTARY_DIM // 2) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    return (low + (high - low) * torch.rand(count, generator=generator)).tolist()


def _phi3(**kw):
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(**{**PHI3, **kw}))


def _longrope(**kw):
    rope = {"rope_type": "longrope", "short_factor": _factors(1, 1.0, 2.0), "long_factor": _factors(2, 2.0, 6.0)}
    return _phi3(partial_rotary_factor=0.75, rope_scaling=rope, **kw)


def _granite(**kw):
    return transformers.GraniteForCausalLM(transformers.GraniteConfig(**{
        **WIDE, "embedding_multiplier": 12.0, "attention_multiplier": 0.09, "residual_multiplier": 0.22,
        "logits_scaling": 8.0, **kw}))


VARIANTS = {
    # Phi-3-mini-4k's shape: fused projections, GQA, a sliding window shorter than the longer prompts
    "phi3": (lambda: _phi3(sliding_window=12), {}),
    # Phi-4-mini's: rotary on 0.75 of each head, tied embeddings
    "phi3-partial-rotary": (lambda: _phi3(partial_rotary_factor=0.75, tie_word_embeddings=True), {}),
    # longrope on a model whose context is the one it was trained at: short_factor, and the attention
    # factor the config gives; written in the rope_scaling spelling of the published Phi-3.5 configs
    "phi3-longrope-short": (lambda: _longrope(max_position_embeddings=64, original_max_position_embeddings=64),
                            {"rope_scaling": {"type": "longrope", "short_factor": _factors(1, 1.0, 2.0),
                                              "long_factor": _factors(2, 2.0, 6.0), "attention_factor": 1.3}}),
    # Phi-3.5-mini's: a context 4x the original, long_factor and sqrt(1 + ln 4 / ln 16) on cos and sin;
    # every prompt is past the original context, where transformers uses long_factor too
    "phi3-longrope-long": (lambda: _longrope(original_max_position_embeddings=ORIGINAL), {}),
    # Granite 3.x's shape: tied embeddings and the four scalars
    "granite": (lambda: _granite(tie_word_embeddings=True), {}),
    "granite-biases": (lambda: _granite(attention_bias=True, mlp_bias=True), {}),
}
LENGTHS = {"phi3-longrope-long": [17, 20, 29, 41]}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    factory, edits = VARIANTS[request.param]
    return request.param, directory, save_random_checkpoint(directory, factory, edits)


# Decode rows go to the C loop where it is built; these also run with it off, on the torch path, so both
# see Granite's softmax scale and Phi-3's sliding window
TORCH_DECODE = {"phi3", "granite"}


@pytest.mark.parametrize("decode_in_c", [True, False], ids=["c-decode", "torch-decode"])
def test_logits_and_greedy_tokens_match_transformers(variant, decode_in_c, monkeypatch):
    name, directory, reference = variant
    if not decode_in_c:
        if name not in TORCH_DECODE:
            pytest.skip("decode attention differs between the paths only in its scale and window")
        monkeypatch.setattr(cpu_attention, "supports", lambda *args: False)
    elif not cpu_attention.available():
        pytest.skip("the C decode attention is not built")
    prompts = random_prompts(LENGTHS.get(name, [3, 9, 20, 41]), seed=11)
    check_against_transformers(directory, reference, prompts, max_tokens=5)


def test_a_long_context_model_rotates_a_short_sequence_as_transformers_rotates_a_long_one(tmp_path, caplog):
    # Served at its full context (4x the original): transformers switches to long_factor once a sequence
    # passes the original context; the engine, whose cached keys must not depend on how a sequence was
    # batched or chunked, uses it from the first token
    reference = save_random_checkpoint(tmp_path, VARIANTS["phi3-longrope-long"][0], {})
    rotary = reference.model.rotary_emb
    long_inv_freq, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["longrope"](
        reference.config, seq_len=ORIGINAL + 1)
    assert not torch.equal(long_inv_freq, rotary.original_inv_freq)
    rotary.original_inv_freq.copy_(long_inv_freq)
    with caplog.at_level("INFO", logger="engine.engine"):
        check_against_transformers(tmp_path, reference, random_prompts([5, 11], seed=3), max_tokens=4)
    assert [r.message.split(",")[0] for r in caplog.records if "longrope" in r.message] == ["longrope: long_factor"]


def _engine(directory: Path, **config) -> LLMEngine:
    return LLMEngine(directory, EngineConfig(kv_cache_bytes=8 << 20, show_progress=False, max_num_batched_tokens=24,
                                             block_size=8, **config))


def test_a_long_context_model_served_within_its_original_context_matches_transformers(tmp_path, caplog):
    # With max_model_len at most the original context no sequence can pass it, so short_factor is what
    # transformers rotates every one of them by; the chunked prompt and the decode rows see it too
    reference = save_random_checkpoint(tmp_path, VARIANTS["phi3-longrope-long"][0], {})
    prompts = random_prompts([5, 11], seed=3)
    with caplog.at_level("INFO", logger="engine.engine"):
        engine = _engine(tmp_path, max_model_len=ORIGINAL)
    assert [r.message.split(",")[0] for r in caplog.records if "longrope" in r.message] == ["longrope: short_factor"]
    ours, logits = greedy_with_logits(engine, prompts, max_tokens=5)
    assert [len(tokens) for tokens in ours] == [5, 5]
    for i, (prompt, tokens) in enumerate(zip(prompts, ours)):
        full = prompt + tokens[:-1]
        with torch.no_grad():
            theirs = reference(torch.tensor([full])).logits[0].float()
        torch.testing.assert_close(torch.stack([logits[(str(i), pos)] for pos in range(len(full))]), theirs,
                                   rtol=1e-4, atol=1e-4)
        assert theirs[len(prompt) - 1:].argmax(-1).tolist() == tokens


TP_CHECKPOINTS = {"phi3-longrope-long": VARIANTS["phi3-longrope-long"][0]}


@pytest.fixture(scope="module")
def parallel_engines(tmp_path_factory):
    made = Engines(tmp_path_factory.mktemp("phi3-granite-parallel"), TP_CHECKPOINTS)
    yield made
    made.close()


@pytest.mark.parallel
@pytest.mark.parametrize("name", sorted(TP_CHECKPOINTS))
def test_tensor_parallel_logits_match_transformers(parallel_engines, name):
    # 4 heads and 2 KV heads over 2 ranks: each takes 2 query heads' and 1 KV head's rows of qkv_proj,
    # and half of the gate rows and half of the up rows of gate_up_proj
    assert_prompt_logits(parallel_engines, name, (2, 1), (1, 1))


@pytest.mark.parallel
def test_every_rank_rotates_by_the_factors_of_the_context_served(tmp_path):
    # The worker rank's heads rotate by short_factor as rank 0's do: a rank left on long_factor would move
    # the all-reduced logits off transformers'
    reference = save_random_checkpoint(tmp_path, VARIANTS["phi3-longrope-long"][0], {})
    engine = _engine(tmp_path, max_model_len=ORIGINAL, tensor_parallel_size=2)
    try:
        prompt = random_prompts([ORIGINAL - 1], seed=5)[0]
        with torch.no_grad():
            theirs = reference(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(engine.prompt_logits(prompt), theirs, rtol=1e-4, atol=1e-4)
    finally:
        engine.shutdown()


def _raw(**changes) -> dict:
    config = transformers.Phi3Config(**PHI3).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, error, message", [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}},
     CheckpointError, "longrope short_factor must list 8 positive numbers"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": "4"}},
     CheckpointError, "longrope long_factor must list 8"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, UnsupportedModelError, "rope type 'linear'"),
    ({"partial_rotary_factor": 0.7}, UnsupportedModelError, "partial_rotary_factor 0.7 leaves 11"),
    ({"partial_rotary_factor": 1.5}, CheckpointError, "partial_rotary_factor must be a number in (0, 1]"),
])
def test_phi3_configs_the_engine_cannot_follow_are_refused_naming_the_key(changes, error, message):
    raw = _raw(**changes)
    raw.pop("rope_parameters", None)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_config(raw, Path("config.json"))


def test_granite_multipliers_are_read_and_default_as_transformers_defaults_them():
    raw = transformers.GraniteConfig(**SMALL, residual_multiplier=0.5).to_dict()
    cfg = parse_config(raw, Path("config.json"))
    assert (cfg.embedding_multiplier, cfg.attention_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == \
        (1.0, 1.0, 0.5, 1.0)
    for key in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"):
        del raw[key]
    assert parse_config(raw, Path("config.json")).attention_multiplier == 1.0   # not 1/sqrt(head_dim)
    with pytest.raises(CheckpointError, match="logits_scaling must be a positive number"):
        parse_config({**raw, "logits_scaling": 0}, Path("config.json"))
