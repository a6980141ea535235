"""The in-flight ledger on sites hosting several models (router/ledger.py): what this router placed for
one model fills that model's own KV pool where the site reports pools apart, and every model's pool
where the site reports one pool; a burst still spreads over the idle sites of its model."""

from __future__ import annotations

from collections import Counter

from router.ledger import InflightLedger
from router.placement import CostModel, PlacementRequest, rank
from router.snapshot import parse_snapshot

PARIS = (48.86, 2.35)
PROMPT_LEN, MAX_TOKENS = 300, 128   # a request holds ceil(428 / 16) = 27 blocks once decoding


def site(name, where, served=("a",), free=1000, models=None, reported_at=100.0):
    capacity = {"kv_blocks_total": 2000, "kv_blocks_free": free, "block_size": 16, "prefix_cache_summary": None,
                "draining": False, "reported_at": reported_at}
    if models is not None:
        capacity["models"] = {model: {"kv_blocks_total": 1000, "kv_blocks_free": own_free}
                              for model, own_free in models.items()}
    return {"name": name, "region": "eu", "country": "XX", "lat": where[0], "lon": where[1],
            "grpc_address": f"{name}:50051", "state": "active", "roles": ["prefill", "decode"],
            "models": [{"model": model, "role": "both"} for model in served], "alive": True, "heartbeat_age_s": 1.0,
            "capacity": capacity}


def snapshot(*sites):
    return parse_snapshot({"version": "1", "generated_at": 0.0, "sites": list(sites), "links": []})


def place(snap, model, ledger):
    request = PlacementRequest(model, list(range(1, PROMPT_LEN + 1)), MAX_TOKENS, *PARIS)
    return rank(snap, request, CostModel(), pending=ledger.pending(snap) if ledger is not None else None)


def burst(snap, model, num_requests, ledger):
    chosen = Counter()
    for _ in range(num_requests):
        best = place(snap, model, ledger)[0]
        chosen[best.site_names] += 1
        if ledger is not None:
            ledger.record(best, PROMPT_LEN, MAX_TOKENS)
    return chosen


def two_model_fleet():
    # s0, the nearest, hosts a and b, with room for one b request in b's own pool (40 blocks);
    # s1..s4 serve a alone.
    shared = site("s0", PARIS, served=("a", "b"), models={"a": 1000, "b": 40})
    return snapshot(shared, *(site(f"s{i}", (PARIS[0] + 0.05 * i, PARIS[1])) for i in range(1, 5)))


def test_a_burst_on_one_model_leaves_the_other_models_pool_alone():
    snap = two_model_fleet()
    assert len(burst(snap, "a", 20, ledger=None)) == 1   # without the ledger: the same idle site twenty times
    ledger = InflightLedger()
    spread = burst(snap, "a", 20, ledger)
    assert set(spread) == {(f"s{i}", f"s{i}") for i in range(5)} and max(spread.values()) <= 6
    # The a requests placed on s0 hold KV in a's pool, not b's: b still goes to s0, its only site.
    assert [c.site_names for c in place(snap, "b", ledger)] == [("s0", "s0")]


def test_a_models_own_placements_still_fill_its_own_pool():
    snap, ledger = two_model_fleet(), InflightLedger()
    ledger.record(place(snap, "b", ledger)[0], PROMPT_LEN, MAX_TOKENS)
    assert place(snap, "b", ledger) == []   # 40 - 19 blocks left: too few for a second b request
    # a's pool is untouched: s0 may still take a (its load, the site's, now ranks it below idle sites)
    assert ("s0", "s0") in [c.site_names for c in place(snap, "a", ledger)]


def test_a_site_with_one_pool_for_all_its_models_counts_every_models_placements():
    # An older agent reports only the site's sums: a and b share its 100 free blocks.
    snap, ledger = snapshot(site("s0", PARIS, served=("a", "b"), free=100)), InflightLedger()
    assert place(snap, "b", ledger)[0].site_names == ("s0", "s0")
    for _ in range(4):
        ledger.record(place(snap, "a", ledger)[0], PROMPT_LEN, MAX_TOKENS)
    assert place(snap, "b", ledger) == []   # 100 - 4 x 19 blocks left


def on_shared_site(candidates):
    return next(c for c in candidates if c.site_names == ("s0", "s0"))


def test_a_resume_fills_its_models_pool_and_a_newer_heartbeat_clears_every_model():
    snap, ledger = two_model_fleet(), InflightLedger()
    shared = snap.sites[0]
    ledger.record_resume(shared, PROMPT_LEN, MAX_TOKENS, model="b")
    ledger.record(on_shared_site(place(snap, "a", ledger)), PROMPT_LEN, MAX_TOKENS)
    assert place(snap, "b", ledger) == []
    assert ledger.pending(snap)["s0"].num_seqs == 2   # the load is the site's: both models' sequences
    newer = snapshot(site("s0", PARIS, served=("a", "b"), models={"a": 1000, "b": 40}, reported_at=101.0))
    assert ledger.pending(newer) == {}
    assert place(newer, "b", ledger)[0].site_names == ("s0", "s0")
