"""Issue 17, defect 1 (router side): a site the router cannot parse is left out and logged, and
every other site is still served; the snapshot as a whole never fails because of one site."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from router.snapshot import ModelKV, SnapshotError, parse_snapshot
from router.snapshot_feed import SnapshotFeed

from test_router_placement import PARIS, site


def poisoned_sites() -> list[dict]:
    bad_capacity = [{"prefix_cache_summary": {"block_size": 16, "hashes": ["zz"]}},
                    {"kv_blocks_total": 2**63}, {"kv_blocks_total": "lots"}, {"block_size": 0},
                    {"num_running": True}, {"decode_tokens_per_s": float("nan")}]
    sites = [site(f"poison-cap-{i}", PARIS, **change) for i, change in enumerate(bad_capacity)]
    for i, change in enumerate([{"name": 7}, {"name": None}, {"lat": "north"}, {"alive": "yes"},
                                {"models": "m"}, {"models": [{"role": "both"}]}, {"models": [1]}, {"roles": [1]},
                                {"models": [{"model": "m", "kv_bytes_per_token": "wide"}]},
                                {"models": [{"model": "m", "kv_bytes_per_token": -4}]},
                                {"models": [{"model": "m", "kv_format": 3}]},
                                {"capacity": [1, 2]}, {"heartbeat_age_s": float("inf")}]):
        sites.append({**site(f"poison-site-{i}", PARIS), **change})
    return [*sites, "not an object", None]


def document(*sites, links=()) -> dict:
    return {"version": "7", "generated_at": 1.0, "sites": list(sites), "links": list(links)}


def test_unparsable_sites_are_skipped_and_logged_once(caplog):
    good = [site("par", PARIS), site("fra", PARIS, prefix_cache_summary={"block_size": 16, "hashes": ["00000000000000ff"]})]
    caplog.set_level(logging.WARNING, logger="router.snapshot")
    for _ in range(3):
        parsed = parse_snapshot(document(good[0], *poisoned_sites(), good[1]))
        assert [s.name for s in parsed.sites] == ["par", "fra"]
    assert parsed.sites[1].capacity.cached_hashes == frozenset({0xff})
    skipped = [r.getMessage() for r in caplog.records]
    assert all(r.exc_info is None for r in caplog.records)
    for i in range(6):
        assert sum(f"'poison-cap-{i}'" in line for line in skipped) == 1, skipped
    for i in range(13):
        assert sum(f"'poison-site-{i}'" in line for line in skipped) <= 1
    assert len(skipped) < 3 * 19  # repeats of one site within the interval are counted, not logged


def test_bad_links_are_skipped():
    links = [{"src": "par", "dst": "fra", "rtt_ms": 3.0, "bandwidth_mbps": 900.0},
             {"src": "par", "dst": "lyo", "rtt_ms": "fast", "bandwidth_mbps": 1.0}, 5]
    parsed = parse_snapshot(document(site("par", PARIS), links=links))
    assert list(parsed.links) == [("par", "fra")]


@pytest.mark.parametrize("doc", [[], "snapshot", {"sites": {}}, {"sites": [], "links": 3}, {"version": 1}])
def test_a_document_that_is_no_snapshot_raises_snapshot_error(doc):
    with pytest.raises(SnapshotError):
        parse_snapshot(doc)


async def test_the_feed_serves_the_good_sites_of_a_poisoned_snapshot():
    async def fetch(_etag):
        return document(site("par", PARIS), site("bad", PARIS, prefix_cache_summary={"block_size": 16,
                                                                                     "hashes": ["zz"]})), "e1"

    feed = SnapshotFeed(fetch, refresh_s=60.0)
    assert await feed.refresh()
    assert [s.name for s in feed.current().sites] == ["par"]


def test_a_sites_own_kv_figures_are_read_per_model():
    entry = site("par", PARIS)
    entry["models"] = [{"model": "m", "role": "both", "kv_bytes_per_token": 65536, "kv_format": "bfloat16/2x2x8/ab"},
                       {"model": "n", "role": "both"}]
    parsed = parse_snapshot(document(entry)).sites[0]
    assert parsed.model_kv == {"m": ModelKV(65536, "bfloat16/2x2x8/ab")}


async def test_the_loop_keeps_serving_while_a_snapshot_is_parsed(monkeypatch):
    # Parsing a large fleet's snapshot takes milliseconds; the router's streams must not wait for it.
    # The parse below only finishes once the event loop has run a callback scheduled after the parse
    # began: were the parse on the loop, that callback could never run, and the refresh would fail.
    from router import snapshot_feed

    loop = asyncio.get_running_loop()
    parsing, loop_ran = asyncio.Event(), threading.Event()

    def parse_while_the_loop_runs(doc):
        loop.call_soon_threadsafe(parsing.set)
        if not loop_ran.wait(5.0):
            raise AssertionError("the event loop did not run while the snapshot was parsed")
        return parse_snapshot(doc)

    async def fetch(_etag):
        return document(site("par", PARIS)), "e1"

    monkeypatch.setattr(snapshot_feed, "parse_snapshot", parse_while_the_loop_runs)
    feed = SnapshotFeed(fetch, refresh_s=60.0)
    refreshing = asyncio.create_task(feed.refresh())
    await asyncio.wait_for(parsing.wait(), 5.0)
    loop_ran.set()
    assert await refreshing
    assert [s.name for s in feed.current().sites] == ["par"]


async def test_refreshes_run_one_at_a_time_so_an_older_snapshot_is_never_adopted_last(monkeypatch):
    # The first fetch answers with an older document and parses slowly; a second refresh started
    # meanwhile must not finish first and then be overwritten by it.
    from router import snapshot_feed

    def parse(doc):
        if doc["version"] == "old":
            time.sleep(0.3)
        return parse_snapshot(doc)

    monkeypatch.setattr(snapshot_feed, "parse_snapshot", parse)
    versions = iter(["old", "new"])
    order = []

    async def fetch(_etag):
        version = next(versions)
        order.append(f"fetch {version}")
        doc = document(site(version, PARIS))
        doc["version"] = version
        return doc, version

    feed = SnapshotFeed(fetch, refresh_s=60.0)
    assert all(await asyncio.gather(feed.refresh(), feed.refresh()))
    assert order == ["fetch old", "fetch new"]
    assert [s.name for s in feed.current().sites] == ["new"]
