"""Predicted outputs as speculation: a request's prediction proposes tokens, verified like any proposal.

Greedy output with a prediction is transformers' greedy output on the same random-weight checkpoint,
whether the prediction is the answer, an edit of it, or wrong, on engines without speculation and with
n-gram or draft-model speculation; a right prediction takes fewer steps, and the request's counts of
kept and rejected prediction tokens say how it fared.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.errors import InvalidRequestError
from engine.ngram import PredictionLookup
from engine.sampling import SamplingParams
from engine.speculative_config import SpeculativeConfig
from tests.engine.test_speculative import (SMALL_POOL, assert_no_leak, draft_ckpt,  # noqa: F401 (a fixture)
                                           quoting_prompt, random_ids)

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = 24
PROMPTS = {"a": random_ids(19, 31), "b": quoting_prompt(32), "c": random_ids(40, 33)}


@pytest.fixture(scope="module")
def ckpt(llama_checkpoint):
    return llama_checkpoint[0]


@pytest.fixture(scope="module")
def reference(llama_checkpoint) -> dict[str, list[int]]:
    """transformers' greedy answer to each prompt."""
    model = llama_checkpoint[1]
    answers = {}
    with torch.no_grad():
        for rid, prompt in PROMPTS.items():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            answers[rid] = out[0, len(prompt):].tolist()
    return answers


def make_engine(directory, speculative: SpeculativeConfig | None = None, **overrides) -> LLMEngine:
    # float32 on the CPU, as the reference runs: the comparison is token for token
    config = dict(kv_cache_bytes=8 << 20, show_progress=False, block_size=8, speculative=speculative, device="cpu",
                  dtype="float32")
    return LLMEngine(directory, EngineConfig(**{**config, **overrides}))


def greedy(prediction: list[int], **kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, prediction_ids=prediction, **kw)


def run(engine: LLMEngine, requests: dict) -> tuple[dict[str, list[int]], dict[str, tuple[int, int]], int]:
    """(tokens, (accepted, rejected) prediction tokens as the last output reports them, steps) of the requests."""
    tokens = {rid: [] for rid in requests}
    counts = {}
    for rid, (prompt_ids, params) in requests.items():
        engine.add_request(rid, prompt_ids, params)
    steps = 0
    while engine.has_work():
        steps += 1
        for out in engine.step():
            tokens[out.request_id].append(out.token.token_id)
            counts[out.request_id] = (out.num_accepted_prediction_tokens, out.num_rejected_prediction_tokens)
    return tokens, counts, steps


def edited(answer: list[int]) -> list[int]:
    """The answer with six tokens of its middle replaced and one inserted: the prediction of an edit."""
    changed = [(t + 7) % 300 + 3 for t in answer[8:14]]
    return answer[:8] + changed + [5] + answer[14:]


SITES = {
    "off": lambda draft: None,
    "ngram": lambda draft: SpeculativeConfig("ngram", 3),
    "draft": lambda draft: SpeculativeConfig("draft", 2, draft_model=str(draft)),
}


@pytest.mark.parametrize("site", list(SITES))
def test_greedy_output_with_any_prediction_is_transformers_greedy_output(ckpt, draft_ckpt, reference, site):
    engine = make_engine(ckpt, SITES[site](draft_ckpt))
    _tokens, _counts, plain_steps = run(engine, {"a": (PROMPTS["a"], greedy([]))})
    predictions = {"a": reference["a"], "b": edited(reference["b"]), "c": random_ids(30, 34)}
    tokens, counts, _steps = run(engine, {rid: (PROMPTS[rid], greedy(predictions[rid])) for rid in PROMPTS})
    assert tokens == reference
    accepted, rejected = counts["a"]
    assert accepted >= MAX_TOKENS // 2 and rejected == 0      # the answer itself: every proposal kept
    assert counts["b"][0] > 0 and counts["b"][1] > 0           # kept around the edit, rejected at it
    assert counts["c"][1] > 0 or counts["c"] == (0, 0)         # wrong: whatever it proposed was rejected
    alone_tokens, _counts, predicted_steps = run(engine, {"a": (PROMPTS["a"], greedy(reference["a"]))})
    assert alone_tokens["a"] == reference["a"] and predicted_steps < plain_steps
    assert_no_leak(engine)


def test_a_wrong_prediction_is_rejected_and_changes_nothing(ckpt, reference):
    engine = make_engine(ckpt)
    wrong = [(t + 1) % 300 + 3 for t in reference["a"]]
    # the output's own first token opens the wrong prediction: every lookup then finds a match to propose from
    tokens, counts, _steps = run(engine, {"a": (PROMPTS["a"], greedy(reference["a"][:1] + wrong))})
    assert tokens["a"] == reference["a"]
    assert counts["a"][0] < counts["a"][1] and counts["a"][1] > 0


def test_seeded_sampling_with_a_prediction_draws_the_plain_tokens(ckpt):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.01, top_k=40, seed=5, ignore_eos=True)
    prompt = quoting_prompt(35)
    plain, _counts, _steps = run(make_engine(ckpt), {"s": (prompt, params)})
    predicted = dataclasses.replace(params, prediction_ids=plain["s"])
    for site in (None, SpeculativeConfig("ngram", 4)):
        tokens, counts, _steps = run(make_engine(ckpt, site), {"s": (prompt, predicted)})
        assert tokens == plain and counts["s"][0] > 0


def test_preempted_and_resumed_requests_keep_their_prediction(ckpt, reference):
    # a small pool: six growing sequences cannot all fit, so some are preempted and recomputed
    engine = make_engine(ckpt, kv_cache_bytes=SMALL_POOL)
    requests = {f"{rid}{i}": (PROMPTS[rid], greedy(reference[rid])) for rid in PROMPTS for i in range(2)}
    tokens, counts, _steps = run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    assert tokens == {f"{rid}{i}": reference[rid] for rid in PROMPTS for i in range(2)}
    assert all(accepted > 0 for accepted, _ in counts.values())
    assert_no_leak(engine)
    # a resume elsewhere: the prompt and the tokens sent so far, and the same prediction
    resumed = make_engine(ckpt, SpeculativeConfig("ngram", 3))
    sent = reference["c"][:10]
    resumed.add_request("c", PROMPTS["c"], greedy(reference["c"]), generated_ids=sent)
    rest, last = [], None
    while resumed.has_work():
        for last in resumed.step():
            rest.append(last.token.token_id)
    assert sent + rest == reference["c"] and last.num_accepted_prediction_tokens > 0


def test_bad_predictions_are_refused(ckpt):
    engine = make_engine(ckpt)
    with pytest.raises(InvalidRequestError, match="prediction token id 320 "):
        engine.add_request("x", [5, 6], greedy([7, 320]))
    with pytest.raises(InvalidRequestError, match="predicted output has 513 tokens"):
        engine.add_request("y", [5, 6], greedy([7] * 513))
    assert not engine.has_work()


def test_a_lookup_follows_the_prediction_in_order():
    # "1 2 3" twice: after the first copy and "9", the second copy's continuation is the one proposed
    lookup = PredictionLookup([1, 2, 3, 4, 1, 2, 3, 5, 6])
    assert lookup.propose([0, 1], 1, 3) == [2, 3, 4]
    assert lookup.propose([0, 1, 2, 3, 4], 1, 2) == [1, 2]
    assert lookup.propose([0, 1, 2, 3, 4, 1, 2, 3], 1, 3) == [5, 6]    # the longest suffix: "4 1 2 3"
    assert lookup.propose([0, 1, 2, 3, 4, 1, 2, 3, 5, 6], 1, 3) == []  # the prediction is used up
    assert lookup.propose([0, 7, 7], 1, 3) == []                      # nothing of the output in it


def test_a_lookup_in_a_repeating_run_proposes_from_the_outputs_own_place():
    lookup = PredictionLookup([5, 1, 2, 1, 2, 1, 2, 9])
    assert lookup.propose([0, 5], 1, 2) == [1, 2]
    lookup.record(2, 2)                                                # kept both, then drew 1
    assert lookup.propose([0, 5, 1, 2, 1], 1, 2) == [2, 1]
    lookup.record(2, 2)                                                # kept both, then drew 2
    assert lookup.propose([0, 5, 1, 2, 1, 2, 1, 2], 1, 2) == [9]       # "1 2 1 2" ends twice: the later is here
    assert (lookup.num_accepted, lookup.num_rejected) == (4, 0)


def test_proposals_kept_past_a_stop_token_are_not_counted_as_accepted(ckpt, reference):
    engine = make_engine(ckpt)
    answer = reference["a"]
    engine.add_request("a", PROMPTS["a"], greedy(answer))
    steps = []  # per step: (its tokens, the request's accepted count after it)
    while engine.has_work():
        outs = engine.step()
        steps.append(([out.token.token_id for out in outs], outs[-1].num_accepted_prediction_tokens))
    # a verifying step that kept 2+ proposals, the first a token new to the answer: the stop token of the run below
    starts = [sum(len(tokens) for tokens, _ in steps[:j]) for j in range(len(steps))]
    j = next(j for j in range(2, len(steps)) if len(steps[j][0]) > 2 and answer[starts[j]] not in answer[:starts[j]])
    stop_at = starts[j]
    tokens, counts, _steps = run(engine, {"a": (PROMPTS["a"], greedy(answer, stop_token_ids=[answer[stop_at]]))})
    assert tokens["a"] == answer[:stop_at + 1]
    # the step kept its first proposal (the stop) and the model would have kept the rest: only the first is output
    num_after_stop = len(steps[j][0]) - 2
    assert counts["a"] == (steps[j - 1][1] + 1, num_after_stop)
    assert_no_leak(engine)


def test_a_site_without_speculation_looks_at_no_sequence_in_a_step_without_predictions(ckpt, reference):
    engine = make_engine(ckpt)
    reads = []  # per step: how often the speculator went through the step's sequences

    class WatchedBatch(list):
        num_reads = 0

        def __iter__(self):
            self.num_reads += 1
            return super().__iter__()

    plan = engine.speculator.plan

    def watched_plan(scheduled):
        batch = WatchedBatch(scheduled)
        num_drafts = plan(batch)
        reads.append(batch.num_reads)
        return num_drafts

    engine.speculator.plan = watched_plan
    plain = {rid: (PROMPTS[rid], greedy([])) for rid in PROMPTS}
    tokens, _counts, _steps = run(engine, plain)
    assert tokens == reference and reads and not any(reads)
    # a request with a prediction among them: the steps look (and it is exact) while it runs ...
    reads.clear()
    tokens, counts, _steps = run(engine, {**plain, "a": (PROMPTS["a"], greedy(reference["a"]))})
    assert tokens == reference and counts["a"][0] > 0 and reads[0] and reads[-1] == 0
    # ... and not once it is gone: finished (the last steps above), or aborted mid-answer
    engine.add_request("gone", PROMPTS["b"], greedy(reference["b"]))
    engine.step()
    engine.step()
    assert engine.abort("gone")
    reads.clear()
    tokens, _counts, _steps = run(engine, plain)
    assert tokens == reference and not any(reads)
    assert_no_leak(engine)


def test_a_decode_site_importing_the_prompts_kv_keeps_the_prediction(ckpt, reference):
    prefill, decode = make_engine(ckpt), make_engine(ckpt)
    params = greedy(reference["c"])
    prefill.add_request("c", PROMPTS["c"], dataclasses.replace(params), prefill_only=True)
    (first,) = prefill.step()
    payload = prefill.export_kv(first.kv_handle)
    prefill.release_kv(first.kv_handle)
    decode.import_kv("c", payload, params, [first.token.token_id])
    rest, last = [], None
    while decode.has_work():
        for last in decode.step():
            rest.append(last.token.token_id)
    assert [first.token.token_id, *rest] == reference["c"]
    assert last.num_accepted_prediction_tokens >= MAX_TOKENS // 2 and last.num_rejected_prediction_tokens == 0
    assert_no_leak(prefill)
    assert_no_leak(decode)


def test_a_long_prediction_is_indexed_compactly_and_one_past_the_limit_is_refused(ckpt):
    import tracemalloc

    from engine.ngram import MAX_PREDICTION_TOKENS

    # every n-gram distinct: the largest index a prediction of the longest allowed length can have
    ids = torch.randint(0, 1 << 17, (MAX_PREDICTION_TOKENS,), generator=torch.Generator().manual_seed(3)).tolist()
    tracemalloc.start()
    try:
        lookup = PredictionLookup(ids)
        num_bytes = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert num_bytes < 96 * MAX_PREDICTION_TOKENS  # a dictionary of n-gram tuples took about 700 a token
    assert lookup.propose([0, *ids[1000:1006]], 1, 5) == ids[1006:1011]
    assert lookup.propose([0, *ids[-3:]], 1, 5) == []
    engine = make_engine(ckpt)
    with pytest.raises(InvalidRequestError, match=f"at most {min(MAX_PREDICTION_TOKENS, engine.max_model_len)}"):
        engine.add_request("x", [5, 6], greedy([7] * (engine.max_model_len + 1)))
    assert not engine.has_work()
