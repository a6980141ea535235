"""Engine features together, under pressure, against transformers on the same random-weight checkpoint.

Each feature has its own tests; these run them at once: a KV pool small enough that sequences are
preempted and recomputed mid-answer, prefix-cache hits on shared prompts and identical forks, chunked
prefill under a small step budget, speculative decoding (n-gram and a draft model), logprobs, stop
token ids, grammar rows, penalized and seeded rows, prefill-only rows moved to a second engine (or
recomputed there once their lease expired), aborts, and the asyncio front with cancelled streams.
What must hold: greedy rows are transformers' greedy tokens (logprobs within float tolerance), a
seeded row's tokens are those it gets running alone on a roomy engine, grammar rows parse and
validate, and once everything ends every KV block is free, no lease is left, the draft pool is whole.
"""

from __future__ import annotations

import asyncio
import json
import random

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from engine.async_engine import AsyncEngine, kv_chunks
from engine.engine import EngineConfig, LLMEngine
from engine.errors import UnknownHandleError
from engine.grammar import json_schema_spec
from engine.kv_transfer import KVPayload
from engine.sampling import SamplingParams
from engine.speculative_config import SpeculativeConfig

# The demo model: 2 layers, 2 KV heads of 16, float32: one block of 8 tokens is 2 KiB.
BLOCK_BYTES = 2 * 2 * 8 * 2 * 16 * 4
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "n": {"type": "integer", "minimum": 0, "maximum": 9}}}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def make_engine(directory, **overrides) -> LLMEngine:
    config = dict(kv_cache_bytes=8 << 20, show_progress=False, block_size=8)
    return LLMEngine(directory, EngineConfig(**{**config, **overrides}))


def reference_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs."""
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        logprobs = model(ids).logits[0].float().log_softmax(-1)
    tokens = ids[0, len(prompt):].tolist()
    return tokens, [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def ids(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(3, 500), k=n)


SHARED = ids(19, 1)   # a prefix several requests share: two full blocks cached after the first
QUOTED = ids(12, 2)


STOP_PROMPT = ids(23, 4)


def mixed_requests(reference) -> dict[str, tuple[list[int], SamplingParams]]:
    stop_at = reference_greedy(reference, STOP_PROMPT, 10)[0][-1]   # stops at its 10th token or before
    return {
        "fork-a": (SHARED + [40], greedy(30, logprobs=2)),
        "aborted": (ids(30, 6), greedy(40)),
        "fork-b": (SHARED + [40], greedy(30, logprobs=0)),      # identical: all but its last token cached
        "fork-c": (SHARED + [41, 42], greedy(26)),
        "quote": (QUOTED + ids(5, 3) + QUOTED[:6], greedy(34)),
        "stop": (STOP_PROMPT, greedy(40, stop_token_ids=[stop_at])),
        "json": (SHARED + [50], SamplingParams(max_tokens=60, temperature=1.0, seed=3, grammar=json_schema_spec(SCHEMA))),
        "seeded": (SHARED + [51, 52], SamplingParams(max_tokens=28, temperature=0.9, top_k=40, top_p=0.95, seed=11,
                                                     ignore_eos=True, logprobs=1)),
        "penalized": (ids(17, 5), SamplingParams(max_tokens=24, temperature=0.8, seed=12, ignore_eos=True,
                                                 repetition_penalty=1.3, presence_penalty=0.5,
                                                 frequency_penalty=0.4, logit_bias={99: 3.0})),
    }


def alone(directory, prompt: list[int], params: SamplingParams) -> list[int]:
    """A request's tokens on a roomy engine with nothing beside it."""
    engine = make_engine(directory)
    engine.add_request("alone", prompt, params)
    tokens = []
    while engine.has_work():
        tokens += [out.token.token_id for out in engine.step()]
    return tokens


def assert_no_leak(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert not engine.sequences and not engine.leases
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert all(block.ref_count == 0 for block in bm.blocks) and bm.num_free_blocks == bm.num_blocks
    proposer = engine.speculator.proposer if engine.speculator is not None else None
    if hasattr(proposer, "copies"):
        assert not proposer.copies and proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks


def drive(prefill: LLMEngine, decode: LLMEngine, requests: dict, prefill_only: set[str],
          abort_at: dict[int, str]) -> tuple[dict[str, list], dict[str, str], dict[str, str]]:
    """Requests arrive two per step; prefill-only ones move to `decode` one step after their prefill (a KV
    import, or a recompute from the first token once their lease expired); `abort_at` names the step at
    which a request is aborted. Returns each request's tokens, its finish reason, and how each moved
    request continued (import or recompute)."""
    tokens: dict[str, list] = {rid: [] for rid in requests}
    reasons: dict[str, str] = {}
    arriving = list(requests)
    prefilled, moves, step = [], {}, 0
    while arriving or prefilled or prefill.has_work() or decode.has_work():
        for rid in arriving[:2]:
            prefill.add_request(rid, *requests[rid], prefill_only=rid in prefill_only)
        arriving = arriving[2:]
        outputs = prefill.step() if prefill.has_work() else []
        for first in prefilled:   # their leases have seen one more step of the prefill engine
            moves[first.request_id] = move(prefill, decode, first, requests[first.request_id])
        prefilled = [out for out in outputs if out.kv_handle is not None and out.finish_reason is None]
        for out in [*outputs, *(decode.step() if decode.has_work() else [])]:
            tokens[out.request_id].append(out.token)
            if out.kv_handle is not None and out.finish_reason is not None:
                prefill.release_kv(out.kv_handle)
            if out.finished and out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
        step += 1
        if step in abort_at and (prefill.abort(abort_at[step]) or decode.abort(abort_at[step])):
            reasons[abort_at[step]] = "abort"
    return tokens, reasons, moves


def move(prefill: LLMEngine, decode: LLMEngine, first, request: tuple[list[int], SamplingParams]) -> str:
    prompt, params = request
    try:
        payload = prefill.export_kv(first.kv_handle)
    except UnknownHandleError:   # the lease expired: the decode site recomputes the prompt
        decode.add_request(first.request_id, prompt, params, generated_ids=[first.token.token_id])
        return "recompute"
    prefill.release_kv(first.kv_handle)
    decode.import_kv(first.request_id, payload, params, [first.token.token_id])
    return "import"


def check_outputs(directory, reference, tokenizer, requests, tokens, reasons) -> None:
    for rid, (prompt, params) in requests.items():
        got = [t.token_id for t in tokens[rid]]
        if reasons.get(rid) == "abort":
            continue
        if params.grammar is not None:
            assert reasons[rid] in ("stop", "length")
            if reasons[rid] == "stop":
                text = tokenizer.decode(got, skip_special_tokens=True)
                jsonschema.validate(json.loads(text), SCHEMA)
            assert got == alone(directory, prompt, params), rid
        elif params.greedy and not params.logit_bias and params.repetition_penalty == 1.0:
            want, logprobs = reference_greedy(reference, prompt, params.max_tokens)
            if params.stop_token_ids:
                want = want[:next((i + 1 for i, t in enumerate(want) if t in params.stop_token_ids), len(want))]
            assert got == want, rid
            if params.logprobs is not None:
                assert [t.logprob for t in tokens[rid]] == pytest.approx(logprobs[:len(got)], abs=2e-3), rid
                assert all(len(t.top_logprobs or []) == params.logprobs for t in tokens[rid])
        else:
            assert got == alone(directory, prompt, params), rid


def test_small_pool_chunked_prefill_ngram_and_kv_moves_give_the_reference_tokens(tiny_model_dir, reference,
                                                                                  tokenizer):
    requests = mixed_requests(reference)
    spec = SpeculativeConfig("ngram", 3, ngram_min=1, accept_threshold=0.05)
    # 14 blocks: the requests' prompts and answers need several times that at once
    prefill = make_engine(tiny_model_dir, kv_cache_bytes=14 * BLOCK_BYTES, max_num_batched_tokens=24, speculative=spec)
    decode = make_engine(tiny_model_dir, kv_cache_bytes=14 * BLOCK_BYTES, block_size=16, speculative=spec)
    tokens, reasons, moves = drive(prefill, decode, requests, {"fork-c", "seeded", "stop"}, {9: "aborted"})
    assert reasons["aborted"] == "abort" and tokens["aborted"]   # aborted mid-answer
    assert reasons["stop"] == "stop" and moves == dict.fromkeys(["fork-c", "seeded", "stop"], "import")
    check_outputs(tiny_model_dir, reference, tokenizer, requests, tokens, reasons)
    assert prefill.scheduler.num_preemptions > 0 and prefill.num_prefix_hit_tokens > 0
    assert prefill.stats().num_accepted_draft_tokens > 0
    assert_no_leak(prefill)
    assert_no_leak(decode)


def test_draft_speculation_with_expired_leases_and_preemption(tiny_model_dir, reference, tokenizer):
    """Leases that expire before they are read (a TTL of 0): the decode engine recomputes from the first
    token. Both engines verify a draft model's proposals (the model as its own draft)."""
    requests = mixed_requests(reference)
    spec = SpeculativeConfig("draft", 3, draft_model=str(tiny_model_dir), accept_threshold=0.05)
    prefill = make_engine(tiny_model_dir, kv_cache_bytes=14 * BLOCK_BYTES, max_num_batched_tokens=48,
                          kv_handle_ttl_s=0.0, speculative=spec)
    decode = make_engine(tiny_model_dir, kv_cache_bytes=14 * BLOCK_BYTES, speculative=spec)
    # draft-verified sampled rows repeat on an engine with the same speculation, not on a plain one
    sampled = {rid for rid, (_, params) in requests.items() if not params.greedy and params.grammar is None}
    tokens, reasons, moves = drive(prefill, decode, {rid: r for rid, r in requests.items() if rid not in sampled},
                                   {"fork-b", "quote", "json"}, {12: "aborted"})
    assert reasons["aborted"] == "abort" and tokens["aborted"]
    assert moves == dict.fromkeys(["fork-b", "quote", "json"], "recompute")
    check_outputs(tiny_model_dir, reference, tokenizer,
                  {rid: r for rid, r in requests.items() if rid not in sampled}, tokens, reasons)
    assert prefill.scheduler.num_preemptions + decode.scheduler.num_preemptions > 0
    assert decode.stats().num_accepted_draft_tokens > 0
    assert_no_leak(prefill)
    assert_no_leak(decode)


def test_a_repetition_penalized_row_gives_the_same_tokens_beside_a_longer_row(tiny_model_dir, reference):
    """The penalty reaches every token already seen, token id 0 included, whatever the length of the rows
    beside it (a batch's shorter histories are padded with id 0 where the penalty is applied)."""
    prompt = [0, 5, 9, 300, 0, 17]
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0, -1]
    best_other = logits[1:].max().item()
    # biased to twice the best other logit, token 0 comes first unless its penalty (/10) applies
    bias = 2 * abs(best_other) - logits[0].item()
    params = greedy(1, repetition_penalty=10.0, logit_bias={0: bias})
    want = alone(tiny_model_dir, prompt, params)
    assert want != [0]
    engine = make_engine(tiny_model_dir)
    engine.add_request("long", ids(60, 8), greedy(1, repetition_penalty=1.5))
    engine.add_request("short", prompt, params)
    outputs = {out.request_id: out.token.token_id for out in engine.step()}
    assert [outputs["short"]] == want


def test_import_onto_cached_generated_tokens_computes_only_the_rest(tiny_model_dir, reference):
    """A resume whose earlier run on this engine cached blocks past the prompt: those are not computed
    (nor written, while others may read them) again, and the answer is the reference's."""
    prompt = ids(16, 9)
    want, _ = reference_greedy(reference, prompt, 20)
    engine = make_engine(tiny_model_dir)
    engine.add_request("first", prompt, greedy(20))
    while engine.has_work():
        engine.step()
    source = make_engine(tiny_model_dir)
    source.add_request("p", prompt, greedy(20), prefill_only=True)
    (first,) = source.step()
    payload = source.export_kv(first.kv_handle)
    source.release_kv(first.kv_handle)
    engine.import_kv("resumed", payload, greedy(20), want[:9])
    scheduled = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda *args: scheduled.append(schedule(*args)) or scheduled[-1]
    tokens = []
    while engine.has_work():
        tokens += [out.token.token_id for out in engine.step()]
    assert want[:9] + tokens == want
    # three cached blocks hold the prompt and 8 generated tokens: only the 9th is computed
    assert [item.num_new_tokens for item in scheduled[0]] == [1]
    assert_no_leak(engine)


async def test_async_streams_cancellations_and_kv_moves_under_pressure(tiny_model_dir, reference):
    """Concurrent streams on two engines: colocated ones, ones left after a few tokens, prefills whose KV
    moves to the other engine by an export read chunk by chunk, prefills whose handle is dropped (they
    expire) or released without waiting."""
    spec = SpeculativeConfig("ngram", 3, ngram_min=1, accept_threshold=0.05)
    config = dict(kv_cache_bytes=14 * BLOCK_BYTES, max_num_batched_tokens=32, kv_handle_ttl_s=3600.0, speculative=spec)
    a = AsyncEngine(make_engine(tiny_model_dir, **config))
    b = AsyncEngine(make_engine(tiny_model_dir, **{**config, "block_size": 16}))
    prompts = {f"r{i}": (SHARED + ids(i % 4, 20 + i) if i % 2 else ids(10 + 3 * i, 20 + i)) for i in range(10)}
    params = greedy(24)

    async def colocated(rid):
        return [e.token_id async for e in a.generate(prompts[rid], params, request_id=rid)]

    async def left(rid):
        async for _ in a.generate(prompts[rid], params, request_id=rid):
            break
        return None

    async def split(rid):
        first = await a.prefill(prompts[rid], params, request_id=rid)
        export = await a.open_export(first.kv_handle)
        try:
            chunks = [chunk async for chunk in kv_chunks(export)]
        finally:
            a.close_export(export)
        a.release_kv_nowait(first.kv_handle)
        payload = KVPayload(export.layout, export.token_ids, chunks)
        rest = [e.token_id async for e in b.generate_from_kv(payload, params, [first.token_id], request_id=rid)]
        return [first.token_id] + rest

    async def dropped(rid):
        await a.prefill(prompts[rid], params, request_id=rid)   # its handle is never read: it expires
        return None

    async def released(rid):
        first = await a.prefill(prompts[rid], params, request_id=rid)
        a.release_kv_nowait(first.kv_handle)
        return None

    roles = [colocated, split, left, split, dropped, colocated, released, split, colocated, left]
    try:
        results = await asyncio.gather(*(role(rid) for role, rid in zip(roles, prompts)))
        for rid, got in zip(prompts, results):
            if got is not None:
                assert got == reference_greedy(reference, prompts[rid], 24)[0], rid
        assert await a.call(lambda engine: engine.expire_handles(now=float("inf"))) == 1   # the dropped one
        for engine in (a, b):
            await engine.call(assert_no_leak)
    finally:
        a.shutdown()
        b.shutdown()
