"""Placement's load inputs, each shown changing the choice: the model's KV bytes per token, decode
load (in-flight decode tokens, the KV a step reads, the measured rate), the router's in-flight
ledger, and bounded session stickiness."""

from __future__ import annotations

from collections import Counter

from test_router_placement import LYON, MODEL, NEW_YORK, PARIS, request, site, snapshot

from engine.prefix_hash import prefix_hashes
from router.ledger import InflightLedger
from router.placement import CostModel, PlacementRequest, rank
from router.sessions import SessionTable, session_key

MADRID = (40.42, -3.70)


def _kv_split_case(kv_bytes_per_token):
    prompt = list(range(1, 2001))
    cached = {"block_size": 16, "hashes": [f"{h:016x}" for h in prefix_hashes(prompt, 16)]}
    # par holds the prompt in its prefix cache but is busy decoding; lyo is idle and cold. Moving the
    # KV over the 4 Gbps link costs about half of what skipping the prefill saves at 32 KiB per token.
    par = site("par", PARIS, num_running=64, inflight_decode_tokens=64 * 400, decode_tokens_per_s=800.0,
               kv_blocks_free=200, prefix_cache_summary=cached)
    link = {"src": "par", "dst": "lyo", "rtt_ms": 4.0, "bandwidth_mbps": 4000.0, "measured_at": 0.0}
    snap = snapshot(par, site("lyo", LYON), links=[link])
    return rank(snap, request(PARIS, prompt_len=2000, kv_bytes_per_token=kv_bytes_per_token), CostModel())[0]


def test_model_with_4x_kv_bytes_per_token_flips_a_marginal_split_to_colocated():
    # The cost model's own default (128 KiB) is not what decides: the model's figure from GetModelInfo is.
    assert _kv_split_case(32768).site_names == ("par", "lyo")
    assert _kv_split_case(4 * 32768).site_names == ("lyo", "lyo")


def served(kv_bytes_per_token=None, kv_format=None):
    entry = {"model": MODEL, "role": "both"}
    if kv_bytes_per_token is not None:
        entry["kv_bytes_per_token"] = kv_bytes_per_token
    if kv_format is not None:
        entry["kv_format"] = kv_format
    return [entry]


def _mixed_kv_case(par_kv=None, lyo_kv=None, model_kv=32768, par_format=None, lyo_format=None):
    """_kv_split_case with each site's own KV figures (what its agent registered for the model)."""
    prompt = list(range(1, 2001))
    cached = {"block_size": 16, "hashes": [f"{h:016x}" for h in prefix_hashes(prompt, 16)]}
    par = site("par", PARIS, num_running=64, inflight_decode_tokens=64 * 400, decode_tokens_per_s=800.0,
               kv_blocks_free=200, prefix_cache_summary=cached)
    par["models"] = served(par_kv, par_format)
    lyo = site("lyo", LYON)
    lyo["models"] = served(lyo_kv, lyo_format)
    link = {"src": "par", "dst": "lyo", "rtt_ms": 4.0, "bandwidth_mbps": 4000.0, "measured_at": 0.0}
    return rank(snapshot(par, lyo, links=[link]), request(PARIS, prompt_len=2000, kv_bytes_per_token=model_kv),
                CostModel())


def test_each_site_is_priced_by_its_own_kv_bytes_per_token():
    # The model's figure (from whichever agent answered GetModelInfo) says 32 KiB per token, but par
    # serves it in a dtype four times as wide: moving its KV costs four times as much, so no split.
    assert _mixed_kv_case(par_kv=4 * 32768)[0].site_names == ("lyo", "lyo")
    # The other way round: par's own narrow KV makes the split pay although the model's figure would not.
    assert _mixed_kv_case(par_kv=32768, model_kv=4 * 32768)[0].site_names == ("par", "lyo")
    # A site that did not register its own figure is priced by the model's, as before.
    assert _mixed_kv_case(lyo_kv=4 * 32768)[0].site_names == ("par", "lyo")


def test_a_site_with_wider_kv_reads_more_per_decode_step():
    def tpot(own_kv):
        entry = site("par", PARIS, decode_tokens_per_s=LONE_RATE, kv_blocks_total=10_000, kv_blocks_free=10_000)
        entry["models"] = served(own_kv)
        return rank(snapshot(entry), request(PARIS, prompt_len=16_000, kv_bytes_per_token=131072), CostModel())[0].tpot_ms

    assert tpot(4 * 131072) > 1.25 * tpot(131072)  # 16,000 tokens: 16 units of KV reading, not 4, beside 33
    assert tpot(None) == tpot(131072)


def test_sites_whose_kv_formats_differ_are_never_paired():
    fp32, bf16 = "float32/4x4x32/1a2b", "bfloat16/4x4x32/1a2b"
    assert _mixed_kv_case(par_format=fp32, lyo_format=fp32)[0].site_names == ("par", "lyo")
    # lyo could not import par's KV (its engine checks the format): the pair is not a candidate at all,
    # not even as a fallback, since the decode site would prefill the whole prompt again.
    ranked = _mixed_kv_case(par_format=fp32, lyo_format=bf16)
    assert ranked[0].site_names == ("lyo", "lyo")
    assert all(c.colocated for c in ranked)
    # One site that did not report its format: nothing is known against the pair.
    assert _mixed_kv_case(par_format=fp32)[0].site_names == ("par", "lyo")


LONE_RATE = 400.0  # tokens/s every site here measures for one sequence alone


def measured_rate(num_running):
    """The decode rate a site as fast as the others measures with num_running sequences (short ones):
    a step costs (fixed + num_running) units of a lone sequence's (fixed + 1), num_running tokens each."""
    fixed = CostModel().decode_step_fixed
    return num_running * LONE_RATE * (fixed + 1) / (fixed + num_running)


def _decode_case(num_running, inflight_decode_tokens):
    # par is nearer the client than mad (~16 ms less round trip); both are as fast.
    par = site("par", PARIS, num_running=num_running, inflight_decode_tokens=inflight_decode_tokens,
               decode_tokens_per_s=measured_rate(num_running) if num_running else LONE_RATE)
    snap = snapshot(par, site("mad", MADRID, decode_tokens_per_s=LONE_RATE))
    return rank(snap, request(PARIS, prompt_len=200, max_tokens=128), CostModel())[0].site_names


def test_site_with_many_inflight_decode_tokens_loses_to_an_idle_one():
    assert _decode_case(0, 0) == ("par", "par")
    # 32 sequences with 500 tokens still to generate each: they share every step of this request's horizon.
    assert _decode_case(32, 32 * 500) == ("mad", "mad")
    # The same 32 sequences about to finish (one token left each) barely overlap this request.
    assert _decode_case(32, 32) == ("par", "par")


def test_decode_step_grows_with_the_kv_it_reads():
    snap = snapshot(site("par", PARIS, decode_tokens_per_s=LONE_RATE, kv_blocks_total=10_000, kv_blocks_free=10_000))
    cost = CostModel()

    def tpot(prompt_len, kv_bytes_per_token):
        req = request(PARIS, prompt_len=prompt_len, kv_bytes_per_token=kv_bytes_per_token)
        return rank(snap, req, cost)[0].tpot_ms

    short, long = tpot(100, 131072), tpot(16_000, 131072)
    assert long > 1.05 * short
    # Four times the KV per token: each step reads four times the bytes for the long context.
    assert tpot(16_000, 4 * 131072) - tpot(100, 4 * 131072) > 3.9 * (long - short)


def _burst(sites, num_requests, ledger):
    snap = snapshot(*sites)
    chosen = Counter()
    for _ in range(num_requests):
        pending = ledger.pending(snap) if ledger is not None else None
        best = rank(snap, request(PARIS, prompt_len=300), CostModel(), pending=pending)[0]
        chosen[best.site_names] += 1
        if ledger is not None:
            ledger.record(best, 300, 128)
    return chosen


def test_burst_of_20_requests_spreads_over_idle_sites():
    sites = [site(f"s{i}", (PARIS[0] + 0.05 * i, PARIS[1]), reported_at=100.0) for i in range(5)]
    assert len(_burst(sites, 20, ledger=None)) == 1  # without the ledger every request sees the same idle site
    spread = _burst(sites, 20, InflightLedger())
    assert set(spread) == {(f"s{i}", f"s{i}") for i in range(5)}
    assert max(spread.values()) <= 6


def test_ledger_is_cleared_by_a_newer_heartbeat_and_by_finished_attempts():
    ledger = InflightLedger()
    first = snapshot(site("par", PARIS, reported_at=100.0))
    attempt = ledger.record(rank(first, request(PARIS, prompt_len=300), CostModel())[0], 300, 128)
    assert ledger.pending(first)["par"].num_seqs == 1
    assert ledger.pending(first)["par"].prefill_tokens == 300
    ledger.prefilled(attempt)
    assert ledger.pending(first)["par"].prefill_tokens == 0  # first token out: the prefill is done
    ledger.finished(attempt)
    assert ledger.pending(first)["par"].num_seqs == 0
    ledger.record(rank(first, request(PARIS), CostModel())[0], 100, 128)
    assert ledger.pending(snapshot(site("par", PARIS, reported_at=100.0)))["par"].num_seqs == 1
    assert ledger.pending(snapshot(site("par", PARIS, reported_at=101.0))) == {}  # the agent counts it now


def _sticky_case(num_running_on_home):
    home = site("s0", PARIS, num_running=num_running_on_home, inflight_decode_tokens=num_running_on_home * 1000,
                decode_tokens_per_s=measured_rate(num_running_on_home))
    sites = [home, site("s1", PARIS, decode_tokens_per_s=LONE_RATE), site("s2", PARIS, decode_tokens_per_s=LONE_RATE)]
    snap, cost = snapshot(*sites), CostModel(session_margin=0.5)
    scores = {c.site_names: c.score_ms for c in rank(snap, request(PARIS), cost)}
    chosen = rank(snap, request(PARIS, session_key="k", session_pair=("s0", "s0")), cost)[0].site_names
    return chosen, scores[("s0", "s0")] / min(scores.values())


def test_session_stays_within_the_margin_and_moves_beyond_it():
    chosen, ratio = _sticky_case(12)
    assert chosen == ("s0", "s0") and 1.2 < ratio < 1.5  # not a near tie, still within 50%
    chosen, ratio = _sticky_case(40)
    assert chosen != ("s0", "s0") and ratio > 1.5


def test_unknown_session_goes_to_the_same_near_best_pair_on_every_router():
    sites = [site(f"s{i}", PARIS) for i in range(4)]
    first = rank(snapshot(*sites), request(PARIS, max_tokens=8, session_key="k"), CostModel())[0].site_names
    # A router that remembers the session across the ocean, far beyond the margin, picks the same pair.
    moved = rank(snapshot(*sites, site("nyc", NEW_YORK)),
                 request(PARIS, max_tokens=8, session_key="k", session_pair=("nyc", "nyc")), CostModel())
    assert moved[0].site_names == first


def test_session_key_is_the_header_else_the_user_within_one_api_key():
    assert session_key("key1", "chat-7", "alice") == session_key("key1", "chat-7", None)
    assert session_key("key1", None, "alice") != session_key("key2", None, "alice")
    assert session_key("key1", None, None) is None


def test_session_table_forgets_idle_and_least_recent_sessions():
    now = [0.0]
    table = SessionTable(max_sessions=2, ttl_s=60.0, clock=lambda: now[0])
    table.remember("a", "p", "d")
    table.remember("b", "p", "p")
    table.remember("c", "q", "q")
    assert table.pair("a") is None and table.pair("b") == ("p", "p")
    now[0] = 61.0
    assert table.pair("c") is None


def test_array_round_trip_estimate_matches_the_scalar_one():
    import math

    import numpy as np

    from router.geometry import rtt_ms_arrays, rtt_ms_between
    points = [PARIS, LYON, NEW_YORK, MADRID, (-33.87, 151.21), (35.68, 139.65)]
    lat = np.radians([p[0] for p in points])
    lon = np.radians([p[1] for p in points])
    arrays = rtt_ms_arrays(math.radians(PARIS[0]), math.radians(PARIS[1]), lat, lon)
    assert np.allclose(arrays, [rtt_ms_between(*PARIS, *p) for p in points], rtol=1e-12)


def test_prefix_cache_counts_only_the_leading_run_of_blocks():
    prompt = list(range(1, 201))
    hashes = prefix_hashes(prompt, 16)
    gap = {"block_size": 16, "hashes": [f"{h:016x}" for h in hashes[:2] + hashes[3:]]}  # block 2 evicted
    whole = {"block_size": 16, "hashes": [f"{h:016x}" for h in hashes]}
    snap = snapshot(site("par", PARIS, prefix_cache_summary=gap), site("lyo", LYON, prefix_cache_summary=whole))
    cached = {c.prefill_site.name: c.num_cached_tokens for c in rank(snap, request(PARIS, prompt_len=200), CostModel())}
    assert cached == {"par": 32, "lyo": 192}


def test_decode_rate_is_read_with_the_load_it_was_measured_under():
    # Both sites are idle now. par measured 1,600 tokens/s while decoding 16 sequences at a time
    # (about 10 ms a step); mad measured 200 tokens/s with one sequence (5 ms a step), so mad is the
    # faster site for a request decoding alone, despite par's larger figure and shorter round trip.
    par = site("par", PARIS, decode_tokens_per_s=1600.0, decode_batch_size=16.0, decode_kv_tokens=16 * 300.0)
    mad = site("mad", MADRID, decode_tokens_per_s=200.0, decode_batch_size=1.0, decode_kv_tokens=300.0)
    assert rank(snapshot(par, mad), request(PARIS), CostModel())[0].site_names == ("mad", "mad")
    # An agent that does not report the load leaves its rate to be read as one sequence's alone.
    par_unreported = site("par", PARIS, decode_tokens_per_s=1600.0)
    assert rank(snapshot(par_unreported, mad), request(PARIS), CostModel())[0].site_names == ("par", "par")


def test_prefix_cache_counts_stay_per_request_when_a_snapshot_serves_many():
    # A shared 64-token opening (four blocks) held to different depths, the last site's summary with
    # a gap; then prompts that stop inside it, at its end, and run past it into text no site holds.
    # The snapshot remembers what each holder holds of a chain; every request must still get what a
    # fresh snapshot would give it, in any order.
    opening = list(range(1000, 1064))
    hashes = prefix_hashes(opening, 16)
    depths = {"par": hashes, "lyo": hashes[:2], "mad": hashes[:1] + hashes[2:]}
    sites = [site(name, where, prefix_cache_summary={"block_size": 16, "hashes": [f"{h:016x}" for h in held]})
             for (name, held), where in zip(depths.items(), (PARIS, LYON, MADRID))]
    prompts = [opening[:40], opening, opening + list(range(5, 105)), opening[:32] + list(range(7, 90)),
               opening + list(range(200, 240)), opening[:48]]

    def cached(snap, prompt):
        found = rank(snap, PlacementRequest(MODEL, prompt, 128, *PARIS), CostModel())
        return {c.prefill_site.name: c.num_cached_tokens for c in found if c.colocated}

    alone = [cached(snapshot(*sites), prompt) for prompt in prompts]
    # the whole opening (4 whole blocks): the engine recomputes the block holding its last token
    assert alone[1] == {"par": 48, "lyo": 32, "mad": 16}
    assert alone[2] == {"par": 64, "lyo": 32, "mad": 16}
    shared = snapshot(*sites)
    for order in (prompts, prompts[::-1], prompts + prompts):
        assert [cached(shared, prompt) for prompt in order] == [alone[prompts.index(p)] for p in order]
