"""The engine's stats count the free blocks its waiting requests will take once scheduled (num_blocks_waiting):
what allocate would take now, as the scheduler checks it, while the prefix cache changes under them."""

from __future__ import annotations

import random

from engine.engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams

BLOCK = 16
BLOCK_BYTES = 8192   # one block of 16 tokens of the tiny model in float32


def make_engine(model_dir, num_blocks: int) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32", block_size=BLOCK, show_progress=False,
                                             kv_cache_bytes=num_blocks * BLOCK_BYTES))


def prompt(n: int, start: int = 7) -> list[int]:
    return [(start + 13 * i) % 500 + 5 for i in range(n)]


def params(max_tokens: int = 2) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK)


def test_waiting_requests_count_their_blocks_until_they_run(tiny_model_dir):
    """A generating request counts its prompt and first token, a prefill-only one its prompt (its lease keeps no
    more); the one the pool cannot hold yet stays counted until it runs, then none is."""
    engine = make_engine(tiny_model_dir, 12)
    assert engine.stats().num_blocks_waiting == 0
    engine.add_request("long", prompt(100), params())
    assert engine.stats().num_blocks_waiting == blocks(101) == 7
    engine.add_request("lease", prompt(96, start=3), params(), prefill_only=True)
    assert engine.stats().num_blocks_waiting == 7 + blocks(96)
    engine.step()   # "long" takes 7 of the 12 blocks; "lease" needs 6 and waits
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_waiting) == (1, 1, 6)
    handle = None
    while engine.has_work():
        handle = next((out.kv_handle for out in engine.step() if out.kv_handle), handle)
    assert engine.stats().num_blocks_waiting == 0
    engine.release_kv(handle)


def test_a_waiting_request_sharing_a_held_prefix_counts_its_uncached_blocks(tiny_model_dir):
    """Leading blocks a KV lease holds are shared, so they take no free block; once the lease ends they are
    evictable, counted free, and a request reviving them takes them from the free ones."""
    engine = make_engine(tiny_model_dir, 16)
    system = prompt(100)
    engine.add_request("system", system, params(), prefill_only=True)
    handle = next(out.kv_handle for out in engine.step() if out.kv_handle)   # holds 7 blocks, 6 of them full
    engine.add_request("shares", system[:96] + prompt(40, start=50), params())
    assert engine.stats().num_blocks_waiting == blocks(137) - 6 == 3
    engine.abort("shares")
    engine.release_kv(handle)
    engine.add_request("revives", system[:96] + prompt(40, start=50), params())
    assert engine.stats().num_blocks_waiting == blocks(137)


def test_a_preempted_sequence_is_counted_again_at_its_grown_size(tiny_model_dir):
    """Sequences that outgrow the pool are preempted back to the queue: each one waiting counts its prompt and the
    tokens it generated, plus the next, although its figure from its first stay in the queue was smaller."""
    engine = make_engine(tiny_model_dir, 10)
    for i in range(4):
        engine.add_request(f"r{i}", prompt(20 + 5 * i, start=i), params(max_tokens=40))
    num_checked = 0
    while engine.has_work():
        stats = engine.stats()   # as the engine thread reads them after every step
        waiting = engine.scheduler.waiting
        assert stats.num_blocks_waiting == sum(blocks(seq.num_tokens + 1) for seq in waiting)
        num_checked += any(seq.num_output_tokens for seq in waiting)
        engine.step()
    assert engine.scheduler.num_preemptions and num_checked
    assert engine.stats().num_blocks_waiting == 0


def admitted_now(engine: LLMEngine) -> int:
    """What the waiting requests' admissions would take if the scheduler admitted them now, figured afresh."""
    manager = engine.block_manager
    return sum(manager.blocks_to_admit(seq, seq.num_tokens + (seq.pooling is None and not seq.prefill_only))
               for seq in engine.scheduler.waiting)


def test_a_lease_ending_under_a_waiting_request_counts_the_blocks_it_will_revive(tiny_model_dir):
    """While a request waits, the lease holding its prefix ends: its 6 shared blocks turn evictable (counted free),
    and reviving them takes them from the free ones, so the request counts all 9 blocks now, not the 3 it
    counted when it arrived (admission would have handed those 6 out again)."""
    engine = make_engine(tiny_model_dir, 16)
    system = prompt(100)
    engine.add_request("system", system, params(), prefill_only=True)
    handle = next(out.kv_handle for out in engine.step() if out.kv_handle)
    engine.add_request("shares", system[:96] + prompt(40, start=50), params())
    assert engine.stats().num_blocks_waiting == 3
    engine.release_kv(handle)
    assert (engine.stats().num_blocks_free, engine.stats().num_blocks_waiting) == (16, blocks(137))


def test_copies_of_a_prompt_waiting_behind_the_one_computing_it_count_only_their_tails(tiny_model_dir):
    """Three choices of one 300-token prompt (n=3): the first is prefilled a chunk a step and the others wait. Each
    block it computes is one the others will share, so what they count falls step by step to their own tail
    (they counted the whole prompt each, 19 blocks, until they ran: admission refused requests that fit)."""
    engine = make_engine(tiny_model_dir, 64)
    engine.scheduler.config.max_num_batched_tokens = 64
    for i in range(3):
        engine.add_request(f"choice-{i}", prompt(300), params())
    counted = []
    while engine.scheduler.waiting:
        counted.append(engine.stats().num_blocks_waiting)
        assert counted[-1] == admitted_now(engine)
        engine.step()
    # a step computes 64 tokens, 4 blocks: each copy waiting shares them from then on
    assert counted[:2] == [3 * blocks(301), 2 * (blocks(301) - 4)] and min(counted) <= 2


def test_the_count_follows_the_cache_through_a_mixed_load(tiny_model_dir):
    """Requests sharing system prompts, prefill-only leases ended at random, aborts and preemptions: whenever the
    stats are read, the waiting requests count what their admissions would take then."""
    num_preemptions = 0
    for seed in range(2):
        rng = random.Random(seed)
        engine = make_engine(tiny_model_dir, 24)
        engine.scheduler.config.max_num_batched_tokens = 64
        systems = [prompt(48, start=s) for s in range(3)]
        handles = []
        for step in range(60):
            for _ in range(rng.randrange(3)):
                ids = rng.choice(systems)[:rng.choice([16, 32, 48])] + prompt(rng.randrange(1, 40), start=100 + step)
                engine.add_request(f"r{seed}-{step}-{len(engine.sequences)}", ids, params(rng.randrange(1, 30)),
                                   prefill_only=rng.random() < 0.3)
            if handles and rng.random() < 0.3:
                engine.release_kv(handles.pop(rng.randrange(len(handles))))
            if engine.scheduler.waiting and rng.random() < 0.1:
                engine.abort(rng.choice(list(engine.scheduler.waiting)).request_id)
            if step % (1 + 4 * seed) == 0:   # seed 1: between reads the changes pile up past the pool's worth
                assert engine.stats().num_blocks_waiting == admitted_now(engine), (seed, step)
            handles += [out.kv_handle for out in engine.step() if out.kv_handle]
        num_preemptions += engine.scheduler.num_preemptions
    assert num_preemptions
