"""Placement credits a site's cached prefix against the free KV blocks a request needs only where running
sequences or KV leases hold it (the summary's first `num_held` hashes): an evictable cached block is among
the free blocks already, and reusing it takes it from them, as the agent's admission counts it. Every cached
block still saves prefill time. A summary without `num_held` (an older agent) is read as all held."""

from __future__ import annotations

import base64

from engine.prefix_hash import prefix_hashes
from router.placement import CostModel, rank
from tests.router.test_router_placement import FRANKFURT, PARIS, request, site, snapshot

PROMPT_LEN = 2000  # 125 whole blocks of 16; the engine reuses the 124 before the one holding the last token
CHAIN = [f"{h:016x}" for h in prefix_hashes(list(range(1, PROMPT_LEN + 1)), 16)]
COST = CostModel()


def summary(num_held: int | None = None, packed: bool = False) -> dict:
    hashes = {"packed_hashes": base64.b64encode(bytes.fromhex("".join(CHAIN))).decode()} if packed else {
        "hashes": CHAIN}
    return {"block_size": 16, **hashes, **({} if num_held is None else {"num_held": num_held})}


def prefill_sites(par_free: int, par_summary: dict) -> list[str]:
    """The prefill sites of the ranked pairs, best first: par (nearly full, the prefix cached) prefills only,
    fra (idle, cold) does both."""
    par = site("par", PARIS, role="prefill", kv_blocks_free=par_free, prefix_cache_summary=par_summary)
    # a small KV per token makes moving the prompt cheap: par, holding the prefix, is the best prefill site
    # whenever it has the room (the split saves fra's 2,000-token prefill)
    ranked = rank(snapshot(par, site("fra", FRANKFURT)), request(PARIS, PROMPT_LEN, kv_bytes_per_token=1024), COST)
    return [c.prefill_site.name for c in ranked]


def test_a_nearly_full_site_whose_cached_prefix_is_only_evictable_is_not_sent_the_prefill():
    # 10 free blocks: the 2 blocks beyond a held prefix fit, the 126 a request reusing evictable blocks takes do not
    assert prefill_sites(10, summary(num_held=len(CHAIN)))[0] == "par"
    assert "par" not in prefill_sites(10, summary(num_held=0))  # the agent would refuse it: KV pool is full
    assert "par" not in prefill_sites(10, summary(num_held=0, packed=True))
    assert prefill_sites(126, summary(num_held=0))[0] == "par"  # room for them all: it fits, its cache saves the prefill


def test_a_partly_held_prefix_earns_room_for_its_held_blocks_and_prefill_time_for_all():
    # 100 of the 124 reused blocks held: 2,000 + 1 tokens less 1,600 need 26 blocks
    assert prefill_sites(26, summary(num_held=100))[0] == "par"
    assert "par" not in prefill_sites(25, summary(num_held=100))
    # The prefix saves the same prefill time held or evictable: the ttft does not tell them apart.
    par = [site("par", PARIS, prefix_cache_summary=summary(num_held=held)) for held in (0, 100, None)]
    firsts = [rank(snapshot(p, site("fra", FRANKFURT)), request(PARIS, PROMPT_LEN), COST)[0] for p in par]
    assert {(c.site_names, c.num_cached_tokens) for c in firsts} == {(("par", "par"), 1984)}
    assert len({c.ttft_ms for c in firsts}) == 1


def test_the_last_whole_block_the_engine_recomputes_earns_no_room_held_or_not():
    # All 125 blocks held: the credit is the 124 reused (2 blocks needed), never 125 (1 block)
    assert "par" not in prefill_sites(1, summary(num_held=len(CHAIN)))
    assert prefill_sites(2, summary(num_held=len(CHAIN)))[0] == "par"
    # the first 124 held, the last evictable: the same
    assert prefill_sites(2, summary(num_held=len(CHAIN) - 1))[0] == "par"
    # the first 123 held: 2,000 + 1 tokens less 1,968 need 3 blocks
    assert "par" not in prefill_sites(2, summary(num_held=len(CHAIN) - 2))
    assert prefill_sites(3, summary(num_held=len(CHAIN) - 2))[0] == "par"


def test_a_summary_without_num_held_reads_as_all_held_as_before():
    # An agent older than the field: the credit every cached block had (it may be refused, never passed over).
    assert prefill_sites(10, summary())[0] == "par"
    assert prefill_sites(10, summary(packed=True))[0] == "par"
    cap = snapshot(site("par", PARIS, prefix_cache_summary=summary())).sites[0].capacity
    assert cap.held_hashes == cap.cached_hashes and len(cap.cached_hashes) == len(CHAIN)
    partly = snapshot(site("par", PARIS, prefix_cache_summary=summary(num_held=3, packed=True))).sites[0].capacity
    assert partly.held_hashes == {int(h, 16) for h in CHAIN[:3]} and len(partly.cached_hashes) == len(CHAIN)
