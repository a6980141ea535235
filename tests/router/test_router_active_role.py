"""The pool planner's active role narrows what a site is placed for, from the next snapshot on."""

from __future__ import annotations

from router.placement import CostModel, rank
from tests.router.test_router_placement import FRANKFURT, PARIS, names, request, site, snapshot


def test_a_site_narrowed_to_prefill_only_prefills():
    flex = site("par", PARIS)
    dec = site("fra", FRANKFURT, role="decode")
    assert ("par", "par") in names(rank(snapshot(flex, dec), request(PARIS), CostModel()))
    flex["active_role"] = "prefill"
    ranked = names(rank(snapshot(flex, dec), request(PARIS), CostModel()))
    assert ranked == [("par", "fra")]  # no colocation on par, and par never decodes


def test_a_site_narrowed_to_decode_only_decodes():
    flex = {**site("par", PARIS), "active_role": "decode"}
    pre = site("fra", FRANKFURT, role="prefill")
    assert names(rank(snapshot(flex, pre), request(PARIS), CostModel())) == [("fra", "par")]
