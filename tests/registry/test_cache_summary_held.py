"""A prefix-cache summary's `num_held` (how many of its leading hashes running sequences or KV leases hold):
bounded by the summary's hashes and refused naming the field when out of range, stored with the heartbeat and
passed to the routers in both snapshot formats; a summary without it stays the bytes it always was."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from registry.http_errors import validation_problem
from registry.snapshot_cache import SnapshotCache
from registry.wire import CapacityReport, ModelCapacity, PrefixCacheSummary, SnapshotCapacity
from router.snapshot import parse_snapshot

from .conftest import capacity
from .test_snapshot_compression import fleet

HASHES = ["00000000000000a1", "00000000000000a2", "00000000000000a3"]
BASE = {"kv_blocks_total": 100, "kv_blocks_free": 10, "block_size": 16}


def refusal(body: dict, contract=CapacityReport) -> str:
    """The registry's 422 message for a heartbeat body (registry.routes_agent)."""
    with pytest.raises(ValidationError) as caught:
        contract.model_validate(body)
    status, message, _code = validation_problem(caught.value.errors(include_url=False))
    assert status == 422
    return message


@pytest.mark.parametrize("num_held", [-1, 4, True, 1.0, "1"])
def test_a_num_held_out_of_range_or_not_an_integer_is_refused_naming_the_field(num_held):
    site = {**BASE, "prefix_cache_summary": {"block_size": 16, "hashes": HASHES, "num_held": num_held}}
    assert "num_held" in refusal(site)
    own = {"kv_blocks_total": 50, "kv_blocks_free": 5,
           "prefix_cache_summary": {"block_size": 16, "hashes": HASHES, "num_held": num_held}}
    assert "num_held" in refusal({**BASE, "models": {"llama": own}})
    packed = {"block_size": 16, "packed_hashes": "AAAAAAAAAKEAAAAAAAAAogAAAAAAAACj", "num_held": num_held}
    assert "num_held" in refusal({**BASE, "prefix_cache_summary": packed}, SnapshotCapacity)


def test_num_held_is_within_the_hashes_sent():
    assert "at most the number of hashes (3), got 4" in refusal(
        {**BASE, "prefix_cache_summary": {"block_size": 16, "hashes": HASHES, "num_held": 4}})
    assert PrefixCacheSummary(block_size=16, hashes=HASHES, num_held=3).num_held == 3
    assert PrefixCacheSummary(block_size=16, num_held=0).num_held == 0


def test_num_held_reaches_the_routers_in_both_snapshot_formats(store, clock):
    ids = fleet(store, 3, lambda i: 0)
    held = PrefixCacheSummary(block_size=16, hashes=HASHES, num_held=1)
    store.telemetry.record_heartbeat(ids[0], capacity(100, 10, 16, prefix_cache_summary=held))
    own = {"llama": ModelCapacity(kv_blocks_total=50, kv_blocks_free=5, prefix_cache_summary=PrefixCacheSummary(
        block_size=16, hashes=HASHES[1:], num_held=0))}
    store.telemetry.record_heartbeat(ids[1], capacity(100, 10, 16, models=own, prefix_cache_summary=PrefixCacheSummary(
        block_size=16, hashes=[])))
    # an agent older than the field
    store.telemetry.record_heartbeat(ids[2], capacity(100, 10, 16, prefix_cache_summary=PrefixCacheSummary(
        block_size=16, hashes=HASHES)))
    cache = SnapshotCache(store.engine, clock=clock)
    plain = cache.get().body
    assert plain.count(b'"num_held"') == 2  # none written for the summary that did not say
    for body in (plain, cache.get(packed=True).body):
        sites = {site.name: site.capacity for site in parse_snapshot(json.loads(body)).sites}
        first, multi, older = sites["site-000"], sites["site-001"], sites["site-002"]
        assert first.held_hashes == {0xA1} and first.cached_hashes == {0xA1, 0xA2, 0xA3}
        assert multi.own("llama").held_hashes == frozenset() and multi.own("llama").cached_hashes == {0xA2, 0xA3}
        assert older.held_hashes == older.cached_hashes == {0xA1, 0xA2, 0xA3}
