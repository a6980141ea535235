"""Prefix cache, preemption, KV export/import, seeded sampling, aborts and handle expiry.

Each feature must give exactly the tokens of a plain run and return every block to the pool.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.errors import InvalidRequestError, KVTransferError, UnknownHandleError
from engine.kv_transfer import KVPayload
from engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def make_engine(directory, **overrides) -> LLMEngine:
    config = dict(kv_cache_bytes=8 << 20, show_progress=False, block_size=8)
    return LLMEngine(directory, EngineConfig(**{**config, **overrides}))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    outputs = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out.token.token_id)
    return outputs


def assert_no_leak(engine: LLMEngine) -> None:
    assert not engine.leases and not engine.sequences
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def moved(source: LLMEngine, target: LLMEngine, request_id: str, prompt_ids: list[int],
          params: SamplingParams) -> tuple[list[int], KVPayload]:
    """Prefill on source, export the KV, import it into target and decode there to the end: (the request's
    tokens, first one included; the payload). Other requests on either engine run along."""
    source.add_request(request_id, prompt_ids, params, prefill_only=True)
    first = None
    while first is None:
        first = next((out for out in source.step() if out.request_id == request_id), None)
    payload = source.export_kv(first.kv_handle)
    source.release_kv(first.kv_handle)
    target.import_kv(request_id, payload, params, [first.token.token_id])
    tokens = [first.token.token_id]
    while target.has_work():
        tokens += [out.token.token_id for out in target.step() if out.request_id == request_id]
    return tokens, payload


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_a_small_pool_gives_the_plain_tokens(directory, kv_cache_bytes: int) -> None:
    """Five requests sharing a 40-token system prompt, in a pool of 24 blocks of 8 tokens (what
    kv_cache_bytes holds for this checkpoint) that cannot hold their five growing 60-token sequences
    at once: some are preempted, the prefix cache is hit, and each request gets the tokens it gets
    alone without a prefix cache."""
    system = prompt(40, seed=1)
    requests = {f"r{i}": (system + prompt(5 + 3 * i, seed=10 + i), SamplingParams(max_tokens=16, temperature=0,
                                                                                   ignore_eos=True))
                for i in range(5)}
    plain = {rid: run(make_engine(directory, enable_prefix_caching=False), {rid: r})[rid]
             for rid, r in requests.items()}
    small = make_engine(directory, kv_cache_bytes=kv_cache_bytes)
    assert small.block_manager.num_blocks == 24
    assert run(small, requests) == plain
    assert small.scheduler.num_preemptions > 0
    assert small.stats().prefix_cache_hit_tokens > 0
    assert_no_leak(small)


@pytest.fixture
def ckpt(llama_checkpoint):
    return llama_checkpoint[0]


def test_prefix_cache_hit_gives_same_tokens(ckpt):
    system = prompt(40, seed=1)
    first, second = system + prompt(5, seed=2), system + prompt(9, seed=3)
    plain = run(make_engine(ckpt, enable_prefix_caching=False), {"b": (second, GREEDY)})["b"]
    engine = make_engine(ckpt)
    run(engine, {"a": (first, GREEDY)})
    outputs, cached = {"b": []}, []
    engine.add_request("b", second, GREEDY)
    while engine.has_work():
        for out in engine.step():
            outputs["b"].append(out.token.token_id)
            cached.append(out.num_cached_tokens)
    assert outputs["b"] == plain
    assert cached[0] == 40  # the five full 8-token blocks of the shared system prompt
    assert engine.stats().prefix_cache_hit_tokens == 40
    assert_no_leak(engine)


def test_identical_prompt_reuses_all_but_last_token(ckpt):
    engine = make_engine(ckpt)
    p = prompt(33, seed=4)
    first = run(engine, {"a": (p, GREEDY)})["a"]
    engine.add_request("b", p, GREEDY)
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert [o.token.token_id for o in outs] == first
    assert outs[0].num_cached_tokens == 32


def test_cache_summary_names_cached_prefix(ckpt):
    from engine.prefix_hash import count_cached_tokens
    engine = make_engine(ckpt)
    p = prompt(50, seed=5)
    run(engine, {"a": (p, GREEDY)})
    summary = engine.cache_summary()
    hashes = {int(h, 16) for h in summary["hashes"]}
    assert count_cached_tokens(p, summary["block_size"], hashes) == 48
    assert count_cached_tokens(prompt(50, seed=6), summary["block_size"], hashes) == 0


def test_lru_eviction_keeps_serving_correctly(ckpt):
    # A pool of 12 blocks forces cached blocks out as new prompts arrive.
    engine = make_engine(ckpt, kv_cache_bytes=12 * 2 * 2 * 8 * 2 * 16 * 4)
    assert engine.block_manager.num_blocks == 12
    prompts = [prompt(40, seed=s) for s in range(4)]
    reference = make_engine(ckpt, enable_prefix_caching=False)
    for i, p in enumerate(prompts + prompts[:1]):
        got = run(engine, {f"r{i}": (p, GREEDY)})[f"r{i}"]
        assert got == run(reference, {f"r{i}": (p, GREEDY)})[f"r{i}"]
    assert_no_leak(engine)


def test_preemption_recompute_gives_same_tokens(ckpt):
    prompts = {f"r{i}": (prompt(20 + 7 * i, seed=10 + i), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
               for i in range(6)}
    plain = run(make_engine(ckpt), prompts)
    # 20 blocks of 8 tokens cannot hold six growing sequences at once.
    small = make_engine(ckpt, kv_cache_bytes=20 * 2 * 2 * 8 * 2 * 16 * 4)
    assert run(small, prompts) == plain
    assert small.scheduler.num_preemptions > 0
    assert_no_leak(small)


def test_seeded_sampling_is_independent_of_batch_companions(ckpt):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=42, ignore_eos=True)
    p = prompt(21, seed=20)
    alone = run(make_engine(ckpt), {"x": (p, params)})["x"]
    others = {f"o{i}": (prompt(10 + i, seed=30 + i), SamplingParams(max_tokens=8, temperature=1.0)) for i in range(5)}
    crowded = run(make_engine(ckpt), {**others, "x": (p, params)})["x"]
    assert alone == crowded
    reseeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=43, ignore_eos=True)
    other_seed = run(make_engine(ckpt), {"x": (p, reseeded)})["x"]
    assert other_seed != alone


PENALIZED = SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True, presence_penalty=0.8,
                           frequency_penalty=0.6, repetition_penalty=1.2, logit_bias={5: 4.0, 9: -3.0}, min_p=0.02,
                           top_k=50)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True),
                                    PENALIZED])
def test_export_import_continuation_matches_plain_run(ckpt, params):
    p = prompt(45, seed=40)
    plain = run(make_engine(ckpt), {"a": (p, params)})["a"]
    source, target = make_engine(ckpt), make_engine(ckpt, block_size=16)
    source.add_request("a", p, params, prefill_only=True)
    (first,) = source.step()
    assert first.kv_handle and first.finished and first.finish_reason is None
    payload = source.export_kv(first.kv_handle)
    assert payload.layout.num_tokens == 45 and payload.num_bytes == 45 * 2 * 2 * 2 * 16 * 4
    source.release_kv(first.kv_handle)
    assert_no_leak(source)
    target.import_kv("a", payload, params, [first.token.token_id])
    rest = []
    while target.has_work():
        rest += [o.token.token_id for o in target.step()]
    assert [first.token.token_id] + rest == plain
    assert_no_leak(target)


def test_import_rejects_corrupt_truncated_or_foreign_payload(ckpt, tmp_path):
    source = make_engine(ckpt, kv_chunk_bytes=1024)
    source.add_request("a", prompt(30, seed=50), GREEDY, prefill_only=True)
    (first,) = source.step()
    payload = source.export_kv(first.kv_handle)
    target = make_engine(ckpt)

    corrupt = source.export_kv(first.kv_handle)
    data = bytearray(corrupt.chunks[3].data)
    data[10] ^= 0xFF
    corrupt.chunks[3].data = bytes(data)
    with pytest.raises(KVTransferError, match="checksum"):
        target.import_kv("c", corrupt, GREEDY, [first.token.token_id])

    truncated = source.export_kv(first.kv_handle)
    truncated.chunks.pop()
    with pytest.raises(KVTransferError, match="incomplete"):
        target.import_kv("t", truncated, GREEDY, [first.token.token_id])

    foreign = source.export_kv(first.kv_handle)
    foreign.layout.model_fingerprint = "another-model"
    with pytest.raises(KVTransferError, match="model_fingerprint"):
        target.import_kv("f", foreign, GREEDY, [first.token.token_id])

    assert_no_leak(target)
    target.import_kv("ok", payload, GREEDY, [first.token.token_id])  # the intact one still works


def test_kv_handles_release_and_expire(ckpt):
    engine = make_engine(ckpt, kv_handle_ttl_s=5.0)
    engine.add_request("a", prompt(30, seed=60), GREEDY, prefill_only=True)
    engine.add_request("b", prompt(30, seed=61), GREEDY, prefill_only=True)
    handles = [out.kv_handle for out in engine.step()]
    engine.release_kv(handles[0])
    with pytest.raises(UnknownHandleError):
        engine.release_kv(handles[0])
    import time
    assert engine.expire_handles(time.monotonic() + 10) == 1
    with pytest.raises(UnknownHandleError):
        engine.export_kv(handles[1])
    assert_no_leak(engine)


def test_abort_at_any_time_frees_blocks(ckpt):
    engine = make_engine(ckpt, max_num_batched_tokens=16)
    engine.add_request("waiting", prompt(40, seed=70), GREEDY)
    engine.add_request("prefilling", prompt(60, seed=71), GREEDY)
    engine.step()
    assert engine.abort("prefilling") and engine.abort("waiting")
    engine.add_request("decoding", prompt(10, seed=72), GREEDY)
    engine.step()
    engine.step()
    assert engine.abort("decoding") and not engine.abort("decoding")
    assert not engine.has_work()
    assert_no_leak(engine)


def test_stop_tokens_and_max_tokens(ckpt):
    engine = make_engine(ckpt)
    p = prompt(12, seed=80)
    free_run = run(engine, {"a": (p, GREEDY)})["a"]
    stop_at = free_run[4]
    stopped = run(engine, {"b": (p, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]))})["b"]
    assert stopped == free_run[: free_run.index(stop_at) + 1]
    assert run(engine, {"c": (p, SamplingParams(max_tokens=3, temperature=0))})["c"] == free_run[:3]


def test_logprobs_are_model_log_softmax(ckpt):
    engine = make_engine(ckpt)
    p = prompt(10, seed=90)
    engine.add_request("a", p, SamplingParams(max_tokens=1, temperature=0, logprobs=3))
    (out,) = engine.step()
    expected = torch.log_softmax(engine.prompt_logits(p)[-1], -1)
    assert out.token.logprob == pytest.approx(float(expected.max()), abs=1e-5)
    ids = [t for t, _ in out.token.top_logprobs]
    assert ids[0] == out.token.token_id and ids == expected.topk(3).indices.tolist()


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0.7, seed=11, ignore_eos=True),
    # penalties depend on the tokens generated so far, which the resuming engine is given
    SamplingParams(max_tokens=12, temperature=0.7, seed=11, ignore_eos=True, presence_penalty=1.5,
                   frequency_penalty=1.0, logit_bias={3: 2.0}, min_p=0.01)])
def test_resume_with_generated_ids_continues_the_same_stream(ckpt, params):
    p = prompt(25, seed=95)
    full = run(make_engine(ckpt), {"a": (p, params)})["a"]
    engine = make_engine(ckpt)
    engine.add_request("r", p, params, generated_ids=full[:5])
    rest = []
    while engine.has_work():
        rest += [o.token.token_id for o in engine.step()]
    assert full[:5] + rest == full


@pytest.mark.parametrize("params, message", [
    (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(temperature=-1), "temperature"),
    (SamplingParams(top_p=0), "top_p"),
    (SamplingParams(top_k=-2), "top_k"),
    (SamplingParams(seed=-5), "seed"),
    (SamplingParams(logprobs=99), "logprobs"),
    (SamplingParams(stop_token_ids=[100000]), "stop token"),
    # values of the wrong type: accepted, each failed later inside a step (of every request in its batch) or
    # never matched
    (SamplingParams(logprobs=2.5), "logprobs must be in .0, 20. and an integer"),
    (SamplingParams(logprobs=True), "logprobs must be in .0, 20. and an integer"),
    (SamplingParams(stop_token_ids=[2.0]), "stop token ids must be integers, got 2.0"),
    (SamplingParams(stop_token_ids=["2"]), "stop token ids must be integers, got '2'"),
    (SamplingParams(temperature="0.5"), "temperature must be a number, got '0.5'"),
    (SamplingParams(min_p="0.1"), "min_p must be a number"),
    (SamplingParams(logit_bias={5: "1"}), "logit_bias values must be in"),
    (SamplingParams(logit_bias={"5": 1.0}), "logit_bias keys must be integer token ids"),
    (SamplingParams(max_tokens=True), "max_tokens must be an integer"),
])
def test_invalid_sampling_values_are_rejected(ckpt, params, message):
    engine = make_engine(ckpt)
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request("a", [1, 2, 3], params)
    assert not engine.has_work()
    assert len(run(engine, {"b": ([1, 2, 3], GREEDY)})["b"]) == GREEDY.max_tokens   # the engine still serves


def test_bad_prompts_are_rejected(ckpt):
    engine = make_engine(ckpt)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(InvalidRequestError, match="context holds 512"):
        engine.add_request("b", [1] * 600, GREEDY)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("c", [1, 5000], GREEDY)
    # ids of another type were reported as outside the vocabulary (numpy) or taken as 1 (True)
    for ids, kind in ((list(np.array([1, 2])), "int64"), ([1, True], "bool"), ("hello", "str")):
        with pytest.raises(InvalidRequestError, match=f"token ids must be Python ints, got .* \\({kind}\\)"):
            engine.add_request("c", ids, GREEDY)
    engine.add_request("d", [1, 2], GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("d", [1, 2], GREEDY)


def test_imports_never_run_more_sequences_than_max_num_seqs(ckpt):
    prompts = [prompt(20, seed=70 + i) for i in range(4)]
    plain = run(make_engine(ckpt), {str(i): (p, GREEDY) for i, p in enumerate(prompts)})
    source, target = make_engine(ckpt), make_engine(ckpt, max_num_seqs=2)
    for i, p in enumerate(prompts):
        source.add_request(str(i), p, GREEDY, prefill_only=True)
    firsts = {out.request_id: out for out in source.step()}
    for rid, first in firsts.items():
        payload = source.export_kv(first.kv_handle)
        source.release_kv(first.kv_handle)
        target.import_kv(rid, payload, GREEDY, [first.token.token_id])
        assert len(target.scheduler.running) <= 2
    outputs = {rid: [first.token.token_id] for rid, first in firsts.items()}
    while target.has_work():
        for out in target.step():
            outputs[out.request_id].append(out.token.token_id)
        assert len(target.scheduler.running) <= 2
    assert outputs == plain
    assert_no_leak(target)


def test_a_short_prompt_is_answered_while_a_long_one_is_still_prefilling(ckpt):
    """Short prompts keep a share of each step from a long prefill (which still moves by at least half
    a budget per step), and both answers are what each would get alone."""
    engine = make_engine(ckpt, max_num_batched_tokens=64)
    alone = {rid: run(engine, {rid: (p, GREEDY)})[rid]
             for rid, p in (("long", prompt(300, seed=1)), ("short", prompt(12, seed=2)))}
    engine = make_engine(ckpt, max_num_batched_tokens=64, enable_prefix_caching=False)
    engine.add_request("long", prompt(300, seed=1), GREEDY)
    assert engine.step() == []  # the first 64-token chunk of the long prompt
    engine.add_request("short", prompt(12, seed=2), GREEDY)
    step = engine.step()
    assert [out.request_id for out in step] == ["short"]
    assert engine.sequences["long"].num_computed_tokens >= 64 + 32
    outputs = {"long": [], "short": [step[0].token.token_id]}
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out.token.token_id)
    assert outputs == alone
    assert_no_leak(engine)


def test_a_short_prompt_is_not_held_behind_a_second_long_prompt_waiting(ckpt):
    """Two long documents ahead (one prefilling, one queued): the short question still gets its
    share of the next step instead of waiting for both; every answer is what it would be alone."""
    long_a, long_b, short = prompt(200, seed=1), prompt(200, seed=3), prompt(12, seed=2)
    engine = make_engine(ckpt, max_num_batched_tokens=64)
    alone = {rid: run(engine, {rid: (p, GREEDY)})[rid] for rid, p in (("a", long_a), ("b", long_b), ("short", short))}
    engine = make_engine(ckpt, max_num_batched_tokens=64, enable_prefix_caching=False)
    engine.add_request("a", long_a, GREEDY)
    engine.add_request("b", long_b, GREEDY)
    assert engine.step() == []  # the first chunk of a; b waits
    engine.add_request("short", short, GREEDY)
    step = engine.step()
    assert [out.request_id for out in step] == ["short"]
    assert engine.sequences["b"].num_computed_tokens == 0  # b still waits its turn behind a
    outputs = {"a": [], "b": [], "short": [step[0].token.token_id]}
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out.token.token_id)
    assert outputs == alone
    assert_no_leak(engine)


def test_stats_report_the_load_the_decode_rate_was_measured_under(ckpt):
    engine = make_engine(ckpt)
    assert (engine.stats().decode_batch_size, engine.stats().decode_kv_tokens) == (0.0, 0.0)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    run(engine, {"a": (prompt(20, seed=1), params), "b": (prompt(30, seed=2), params)})
    stats = engine.stats()
    assert stats.decode_tokens_per_s > 0
    # Two sequences decoded side by side, holding 20-55 tokens of KV between them at each step.
    assert 1.5 < stats.decode_batch_size <= 2.0
    assert 50 <= stats.decode_kv_tokens <= 62


def test_steps_with_a_prompt_chunk_do_not_pass_for_fast_decoding(ckpt, monkeypatch):
    """A site that prefills a document in chunks beside a chat reports the decode rate of its decode
    steps (what routers price its decoding by), not the mixed steps' tokens per second, and its
    prefill rate from the time the prompt tokens added. The clock is the model's: a step costs
    10 ms plus 0.1 ms per prompt token, so decoding runs at 100 tokens/s for one sequence."""
    import engine.engine as engine_module

    engine = make_engine(ckpt, max_num_batched_tokens=32)
    now = [0.0]
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: now[0], monotonic=time.monotonic))
    schedule, forward, last = engine.scheduler.schedule, engine.executor.run, []

    def scheduled(*args, **kwargs):
        last[:] = schedule(*args, **kwargs)
        return last

    def run_model(inputs):
        now[0] += 0.010 + 0.0001 * sum(i.num_new_tokens for i in last if i.num_new_tokens > 1)
        return forward(inputs)

    monkeypatch.setattr(engine.scheduler, "schedule", scheduled)
    monkeypatch.setattr(engine.executor, "run", run_model)
    engine.add_request("chat", prompt(10, seed=1), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()  # the chat's prompt
    engine.add_request("document", prompt(100, seed=2), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    stats = engine.stats()
    assert stats.steps.num_decode_tokens_in_prefill_steps == 4  # the chat decoded beside the document's chunks
    assert stats.decode_tokens_per_s == pytest.approx(100.0)  # one sequence, 10 ms a step
    assert stats.decode_batch_size == pytest.approx(1.0)
    # the chat's prompt step alone (10 tokens in 11 ms), then chunks whose prompt tokens took 0.1 ms each
    assert 900.0 < stats.prefill_tokens_per_s < 10000.0


def test_step_totals_count_the_decode_tokens_a_prefill_chunk_held_up(ckpt):
    engine = make_engine(ckpt, max_num_batched_tokens=32)
    engine.add_request("chat", prompt(10, seed=1), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()  # the chat's prompt
    engine.add_request("document", prompt(100, seed=2), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    steps = engine.stats().steps
    # The document's 100 tokens went in chunks of 31 (the chat decoding took one token of each
    # 32-token step): four steps with prefill, each of which also decoded one chat token while the
    # chat ran; the chat's own prompt was the first prefill step.
    assert steps.num_prefill_tokens == 110
    assert steps.num_prefill_steps == 5
    assert steps.num_decode_tokens_in_prefill_steps == 4
    assert steps.num_decode_tokens == 7  # the chat's 8 tokens: one sampled by its prefill, 7 decoded
    assert steps.num_decode_steps == 7 - 4
    assert steps.prefill_step_seconds > 0 and steps.decode_step_seconds > 0
