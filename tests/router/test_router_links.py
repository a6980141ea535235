"""Measured links in placement: a fresh measurement replaces the distance estimate; a stale one does not."""

from __future__ import annotations

from engine.prefix_hash import prefix_hashes
from router.placement import CostModel, rank
from router.snapshot import parse_snapshot
from tests.router.test_router_placement import LYON, PARIS, request, site

NOW = 1_000_000.0
PROMPT_LEN = 2000


def _ranked(links=(), cost: CostModel | None = None):
    """par holds the prompt in its prefix cache but is saturated with decoding; lyo is idle and cold.
    With a fast path between them, prefilling at par and decoding at lyo wins."""
    prompt = list(range(1, PROMPT_LEN + 1))
    cached = {"block_size": 16, "hashes": [f"{h:016x}" for h in prefix_hashes(prompt, 16)]}
    par = site("par", PARIS, num_running=200, prefix_cache_summary=cached)
    lyo = site("lyo", LYON)
    doc = {"version": "1", "generated_at": NOW, "sites": [par, lyo], "links": list(links)}
    cost = cost or CostModel(default_bandwidth_mbps=10_000, link_max_age_s=300.0)
    return rank(parse_snapshot(doc), request(PARIS, prompt_len=PROMPT_LEN), cost)


def _link(bandwidth_mbps: float, age_s: float, src="lyo", dst="par", rtt_ms=4.0) -> dict:
    return {"src": src, "dst": dst, "rtt_ms": rtt_ms, "bandwidth_mbps": bandwidth_mbps, "measured_at": NOW - age_s}


def test_without_a_measurement_the_distance_estimate_makes_the_split_pay():
    assert _ranked()[0].site_names == ("par", "lyo")


def test_a_measured_slow_link_flips_the_split_to_colocated():
    best = _ranked([_link(bandwidth_mbps=100, age_s=10)])[0]
    assert best.site_names == ("lyo", "lyo")
    assert best.colocated


def test_a_stale_measurement_is_ignored():
    best = _ranked([_link(bandwidth_mbps=100, age_s=3600)])[0]
    assert best.site_names == ("par", "lyo")
    split = next(c for c in _ranked([_link(bandwidth_mbps=100, age_s=3600)]) if not c.colocated)
    assert split.transfer_ms == next(c for c in _ranked() if not c.colocated).transfer_ms


def test_the_newest_direction_of_a_pair_wins():
    # A fresh fast measurement one way outweighs an older slow one the other way, and vice versa.
    fast_new = [_link(bandwidth_mbps=100, age_s=200), _link(bandwidth_mbps=50_000, age_s=5, src="par", dst="lyo")]
    assert _ranked(fast_new)[0].site_names == ("par", "lyo")
    slow_new = [_link(bandwidth_mbps=100, age_s=5), _link(bandwidth_mbps=50_000, age_s=200, src="par", dst="lyo")]
    assert _ranked(slow_new)[0].site_names == ("lyo", "lyo")
