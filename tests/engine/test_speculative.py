"""Speculative decoding against the engine without it: the same greedy tokens, the same law for sampling.

Both proposers (n-gram prompt lookup, a draft model) at k = 1, 3, 5, batched with requests that do
not speculate, through preemptions (a small KV pool), prefix-cache hits, aborts and a KV import; the
KV pools (the model's and the draft's) are whole again after every run.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.speculative_config import SpeculativeConfig
from tests.engine.conftest import SMALL

VOCAB = SMALL["vocab_size"]
# 20 blocks of 8 tokens (2 layers, 2 KV heads of 16, float32): six growing sequences cannot all fit
SMALL_POOL = 20 * 2 * 2 * 8 * 2 * 16 * 4


def make_engine(directory, speculative: SpeculativeConfig | None = None, **overrides) -> LLMEngine:
    config = dict(kv_cache_bytes=8 << 20, show_progress=False, block_size=8, speculative=speculative)
    return LLMEngine(directory, EngineConfig(**{**config, **overrides}))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
        check_blocks: bool = False) -> dict[str, list[int]]:
    outputs = {rid: [] for rid in requests}
    for rid, (prompt_ids, params) in requests.items():
        engine.add_request(rid, prompt_ids, params)
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out.token.token_id)
        if check_blocks:
            assert_exact_blocks(engine)
    return outputs


def assert_exact_blocks(engine: LLMEngine) -> None:
    """Between steps a decoding sequence holds exactly the blocks of its computed tokens, as without
    speculation (a block grown for rejected proposals went back), and every block is in use or free once."""
    pools = [(engine.block_manager, engine.scheduler.running)]
    if engine.speculator is not None and hasattr(engine.speculator.proposer, "copies"):
        pools.append((engine.speculator.proposer.block_manager, list(engine.speculator.proposer.copies.values())))
    for bm, seqs in pools:
        for seq in seqs:
            if seq.block_table and seq.num_computed_tokens >= seq.num_tokens - 1:
                assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens), seq
        in_use = sum(1 for block in bm.blocks if block.ref_count)
        assert in_use + bm.num_free_blocks == bm.num_blocks


def assert_no_leak(engine: LLMEngine) -> None:
    assert not engine.leases and not engine.sequences
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    draft = getattr(engine.speculator.proposer, "block_manager", None) if engine.speculator else None
    if draft is not None:
        assert draft.num_free_blocks == draft.num_blocks and not engine.speculator.proposer.copies


def random_ids(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def quoting_prompt(seed: int) -> list[int]:
    """A passage, other text, then the passage again: lookups find what follows its start."""
    passage = random_ids(14, seed)
    return passage + random_ids(5, seed + 100) + passage[:6]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


# Speculating and not, different lengths, a stop token, penalties and a bias (applied to every
# verified row as to a plain one), logprobs, end-of-sequence left on.
REQUESTS = {
    "quote": (quoting_prompt(1), greedy(40)),
    "plain": (random_ids(23, 2), greedy(32)),
    "opted-out": (quoting_prompt(3), greedy(30, no_speculation=True)),
    "penalized": (quoting_prompt(4), greedy(28, repetition_penalty=1.2, frequency_penalty=0.3, logit_bias={7: 1.5})),
    "logprobs": (quoting_prompt(5), greedy(25, logprobs=2)),
    "eos": (quoting_prompt(6), SamplingParams(max_tokens=36, temperature=0)),
    "short": (quoting_prompt(7), greedy(2)),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(llama_checkpoint):
    return llama_checkpoint[0]


@pytest.fixture(scope="module")
def draft_ckpt(llama_checkpoint, tmp_path_factory):
    """A one-layer draft: the model's embedding, first layer and head (it agrees with the model often, not always)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("draft")
    draft = LlamaForCausalLM(LlamaConfig(**{**SMALL, "num_hidden_layers": 1}))
    draft.load_state_dict(llama_checkpoint[1].state_dict(), strict=False)
    draft.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def plain_outputs(ckpt):
    return run(make_engine(ckpt), REQUESTS)


def speculative(method: str, k: int, draft_dir=None) -> SpeculativeConfig:
    return SpeculativeConfig(method, k, draft_model=str(draft_dir) if method == "draft" else None)


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_tokens_equal_plain_decoding_through_preemption(ckpt, draft_ckpt, plain_outputs, method, k):
    engine = make_engine(ckpt, speculative(method, k, draft_ckpt), kv_cache_bytes=SMALL_POOL)
    assert run(engine, REQUESTS, check_blocks=True) == plain_outputs
    stats = engine.stats()
    assert engine.scheduler.num_preemptions > 0
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens  # kept some, rolled back others
    assert len(plain_outputs["short"]) == 2 and len(plain_outputs["quote"]) == 40
    assert_no_leak(engine)


def test_prefix_cache_hits_and_logprobs_under_speculation(ckpt, draft_ckpt, plain_outputs):
    engine = make_engine(ckpt, speculative("draft", 3, draft_ckpt))
    first = run(engine, REQUESTS)
    prompt_ids, params = REQUESTS["logprobs"]
    engine.add_request("again", prompt_ids, params)
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert first == plain_outputs and [o.token.token_id for o in outs] == plain_outputs["logprobs"]
    assert outs[0].num_cached_tokens == len(prompt_ids) // 8 * 8
    reference = make_engine(ckpt)
    reference.add_request("again", prompt_ids, params)
    plain = []
    while reference.has_work():
        plain += reference.step()
    for got, want in zip(outs, plain):
        assert got.token.logprob == pytest.approx(want.token.logprob, abs=1e-4)
        assert [t for t, _ in got.token.top_logprobs] == [t for t, _ in want.token.top_logprobs]
    assert_no_leak(engine)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_split_run_decodes_imported_kv_with_speculation(ckpt, draft_ckpt, plain_outputs, method):
    """The prefill engine exports the prompt's K/V; the decode engine imports it and speculates."""
    source, target = make_engine(ckpt), make_engine(ckpt, speculative(method, 3, draft_ckpt), block_size=16)
    firsts = {}
    for rid, (prompt_ids, params) in REQUESTS.items():
        source.add_request(rid, prompt_ids, params, prefill_only=True)
    while source.has_work():
        for out in source.step():
            firsts[out.request_id] = out
    outputs = {}
    for rid, first in firsts.items():
        outputs[rid] = [first.token.token_id]
        if first.finish_reason is not None:  # max_tokens 1 or end-of-sequence at once: nothing to decode
            continue
        payload = source.export_kv(first.kv_handle)
        source.release_kv(first.kv_handle)
        target.import_kv(rid, payload, REQUESTS[rid][1], [first.token.token_id])
    while target.has_work():
        for out in target.step():
            outputs[out.request_id].append(out.token.token_id)
    assert outputs == plain_outputs
    assert target.stats().num_accepted_draft_tokens > 0
    assert_no_leak(target)


# A random model's logits differ by hundredths: at these temperatures its sampled answers repeat as its
# greedy ones do (so n-gram proposals exist) while still drawing more than one token now and then.
SAMPLED = {
    "warm": (quoting_prompt(11), SamplingParams(max_tokens=30, temperature=0.01, seed=5, ignore_eos=True)),
    "filtered": (quoting_prompt(12), SamplingParams(max_tokens=30, temperature=0.015, top_k=40, top_p=0.9, seed=6,
                                                    ignore_eos=True)),
    "penalized": (quoting_prompt(13), SamplingParams(max_tokens=30, temperature=0.01, seed=7, ignore_eos=True,
                                                     presence_penalty=0.5, frequency_penalty=0.3, min_p=0.02,
                                                     logit_bias={9: 2.0})),
    "greedy": (quoting_prompt(14), greedy(30)),
}


def test_ngram_seeded_sampling_gives_the_plain_tokens(ckpt):
    """An n-gram proposal is kept exactly when the plain sampler draws it: seeded output is unchanged."""
    plain = run(make_engine(ckpt), SAMPLED)
    engine = make_engine(ckpt, speculative("ngram", 4))
    assert run(engine, SAMPLED) == plain
    stats = engine.stats()
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert_no_leak(engine)


def test_draft_seeded_sampling_repeats_exactly(ckpt, draft_ckpt):
    config = speculative("draft", 3, draft_ckpt)
    # another engine with the same speculative config: other block size and pool, the requests alone
    first_engine = make_engine(ckpt, config)
    second_engine = make_engine(ckpt, config, block_size=16, kv_cache_bytes=16 << 20)
    first = run(first_engine, SAMPLED)
    second = {rid: run(second_engine, {rid: request})[rid] for rid, request in SAMPLED.items()}
    assert first == second
    assert first_engine.stats().num_accepted_draft_tokens > 0
    reseeded = {rid: (p, dataclasses.replace(params, seed=99))
                for rid, (p, params) in SAMPLED.items() if rid == "warm"}
    assert run(make_engine(ckpt, config), reseeded)["warm"] != first["warm"]
    assert_no_leak(first_engine)


def test_aborts_and_preemptions_under_speculation_leave_no_blocks(ckpt, draft_ckpt):
    engine = make_engine(ckpt, speculative("draft", 4, draft_ckpt), kv_cache_bytes=SMALL_POOL)
    for rid, (prompt_ids, params) in REQUESTS.items():
        engine.add_request(rid, prompt_ids, params)
    for _ in range(6):
        engine.step()
    assert engine.abort("quote") and engine.abort("plain")
    for _ in range(8):
        engine.step()
    assert engine.stats().num_draft_tokens > 0
    for rid in list(engine.sequences):
        engine.abort(rid)
    assert not engine.has_work()
    assert_no_leak(engine)


# -- the law of speculative sampling with a draft model ----------------------------------------------

TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=64, vocab_size=8, max_position_embeddings=64, bos_token_id=0, eos_token_id=1)


def tiny_model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    with torch.no_grad():  # logits spread over a few units: distributions neither flat nor one-hot
        model.lm_head.weight.normal_(0.0, 0.4)
    return model


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    target_dir, draft_dir = tmp_path_factory.mktemp("tiny-target"), tmp_path_factory.mktemp("tiny-draft")
    target = tiny_model(7)
    target.save_pretrained(target_dir)
    tiny_model(8).save_pretrained(draft_dir)
    return target_dir, draft_dir, target


def chi_square_bound(df: int, z: float = 4.75) -> float:
    """The chi-square quantile with upper tail ~1e-6 (z: the normal quantile), by Wilson and Hilferty."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def test_draft_sampling_follows_the_models_distribution(tiny_pair):
    """The first three tokens of 3,000 seeded requests against their exact law under the model alone
    (transformers on the same checkpoint): a chi-square test whose false-failure chance is ~1e-6;
    the seeds are fixed, so the verdict is the same on every run."""
    target_dir, draft_dir, reference = tiny_pair
    prompt_ids = [0, 5, 3, 6, 2]
    num_requests = 3000
    engine = LLMEngine(target_dir, EngineConfig(
        kv_cache_bytes=4 << 20, show_progress=False, block_size=8, max_num_seqs=256, max_num_batched_tokens=2048,
        speculative=SpeculativeConfig("draft", 3, draft_model=str(draft_dir), accept_threshold=0.01)))
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True) for seed in range(num_requests)]
    outputs = run(engine, {str(seed): (prompt_ids, p) for seed, p in enumerate(params)})
    stats = engine.stats()
    assert stats.num_draft_tokens >= num_requests  # every request verified proposals
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert_no_leak(engine)

    # exact law: p(t1) p(t2 | t1) p(t3 | t1, t2) from one forward over every (t1, t2)
    vocab = TINY["vocab_size"]
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))
    contexts = torch.cat([torch.tensor(prompt_ids).expand(len(pairs), -1), pairs], dim=1)
    with torch.no_grad():
        probs = reference(contexts).logits.double().softmax(-1)
    n = len(prompt_ids)
    p1, p2, p3 = probs[0, n - 1], probs[::vocab, n].reshape(vocab, vocab), probs[:, n + 1].reshape(vocab, vocab, vocab)
    law = (p1[:, None, None] * p2[:, :, None] * p3).flatten()
    counts = torch.zeros(vocab ** 3, dtype=torch.float64)
    for tokens in outputs.values():
        counts[tokens[0] * vocab * vocab + tokens[1] * vocab + tokens[2]] += 1
    expected = law * num_requests
    # cells expected fewer than 5 times are pooled into one
    rare = expected < 5
    observed = torch.cat([counts[~rare], counts[rare].sum()[None]])
    expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
    statistic = float(((observed - expected) ** 2 / expected).sum())
    # (a residual drawn from p instead of max(0, p - q) scores ~370 here; accepting with probability q ~3,900)
    assert statistic < chi_square_bound(len(observed) - 1), (statistic, len(observed))


# -- configuration -----------------------------------------------------------------------------------

@pytest.mark.parametrize("config, message", [
    (SpeculativeConfig("medusa"), "method"),
    (SpeculativeConfig("ngram", 0), "num_speculative_tokens"),
    (SpeculativeConfig("ngram", ngram_min=3, ngram_max=2), "ngram_min"),
    (SpeculativeConfig("draft"), "draft_model"),
    (SpeculativeConfig("ngram", accept_threshold=1.5), "accept_threshold"),
])
def test_bad_speculative_settings_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative=config).validate()


def test_pipeline_parallelism_refuses_speculation():
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineConfig(pipeline_parallel_size=2, speculative=SpeculativeConfig()).validate()


def test_a_draft_with_another_vocabulary_is_refused(ckpt, tiny_pair):
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(ckpt, SpeculativeConfig("draft", draft_model=str(tiny_pair[1])))


def test_grammar_rows_beside_speculating_rows_get_their_masks(tiny_model_dir):
    """Constrained requests never speculate, but share steps with rows that verify proposals: each row
    must get its own grammar mask (the model as its own draft: every greedy proposal is kept)."""
    from engine.grammar import json_schema_spec

    schema = {"type": "object", "required": ["name"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "maxLength": 12}}}
    requests = {
        **{f"json{seed}": (list(range(40, 52)), SamplingParams(max_tokens=60, temperature=1.0, seed=seed,
                                                               grammar=json_schema_spec(schema))) for seed in range(3)},
        **{f"free{i}": (random_ids(20, 60 + i, vocab=500), greedy(30)) for i in range(3)},
    }
    plain = run(make_engine(tiny_model_dir), requests)
    engine = make_engine(tiny_model_dir, SpeculativeConfig("draft", 3, draft_model=str(tiny_model_dir)))
    assert run(engine, requests, check_blocks=True) == plain
    assert engine.stats().num_accepted_draft_tokens > 0
    assert_no_leak(engine)


@pytest.mark.parallel
def test_ngram_speculation_with_tensor_parallelism(ckpt, plain_outputs):
    """Rank 0 proposes and verifies; the other rank only runs the 1 + k rows like any chunk."""
    engine = make_engine(ckpt, speculative("ngram", 3), tensor_parallel_size=2)
    try:
        assert run(engine, REQUESTS, check_blocks=True) == plain_outputs
        assert engine.stats().num_accepted_draft_tokens > 0
        assert_no_leak(engine)
    finally:
        engine.shutdown()
