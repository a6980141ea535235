"""The router reads a snapshot whose prefix-cache hashes come packed (base64 of 8-byte words) exactly as one
whose hashes come as hex strings: same hashes, same placements; a site whose packed hashes are malformed is
left out and logged, like any site that does not parse. A registry answer that does not decode is reported as
`bad_encoding`, apart from a registry that cannot be reached."""

from __future__ import annotations

import logging
import zlib

import httpx
import pytest

from engine.prefix_hash import prefix_hashes
from registry.client import RegistryClient
from registry.wire import PACKED_SNAPSHOT_MEDIA_TYPE, pack_cache_hashes
from router.placement import CostModel, rank
from router.snapshot import parse_snapshot
from router.snapshot_feed import REGISTRY_BAD_ENCODING, REGISTRY_OK, REGISTRY_UNREACHABLE, SnapshotFeed

from test_router_placement import LYON, MODEL, PARIS, request, site
from test_router_snapshot import document
from test_snapshot_decode_off_loop import PLAIN, Wire, corrupted

PROMPT = list(range(1, 2001))
HASHES = [f"{h:016x}" for h in prefix_hashes(PROMPT, 16)]


def packed(summary: dict) -> dict:
    return {"block_size": summary["block_size"], "packed_hashes": pack_cache_hashes(summary["hashes"])}


def fleet(pack) -> dict:
    """par caches the prompt for the model (apart, as a site hosting two models reports it); lyo caches
    part of it in its site-wide summary; both shapes of summary written by `pack`."""
    own = {MODEL: {"kv_blocks_total": 500, "kv_blocks_free": 400, "prefix_cache_summary": pack(
               {"block_size": 16, "hashes": HASHES})},
           "other": {"kv_blocks_total": 500, "kv_blocks_free": 500, "prefix_cache_summary": None}}
    par = site("par", PARIS, num_running=2, models=own, prefix_cache_summary=pack({"block_size": 16, "hashes": []}))
    lyo = site("lyo", LYON, prefix_cache_summary=pack({"block_size": 16, "hashes": HASHES[:40]}))
    return document(par, lyo)


def test_packed_hashes_place_exactly_as_hex_hashes():
    as_hex, as_packed = parse_snapshot(fleet(lambda s: s)), parse_snapshot(fleet(packed))
    for hex_site, packed_site in zip(as_hex.sites, as_packed.sites, strict=True):
        for model in (MODEL, "other", "unknown"):
            hex_own, packed_own = hex_site.capacity.own(model), packed_site.capacity.own(model)
            assert packed_own.cached_hashes == hex_own.cached_hashes
            assert packed_own.cache_block_size == hex_own.cache_block_size
    assert as_packed.sites[0].capacity.own(MODEL).cached_hashes == {int(h, 16) for h in HASHES}
    placed = [[(c.site_names, c.num_cached_tokens) for c in rank(parsed, request(PARIS, prompt_len=2000), CostModel())]
              for parsed in (as_hex, as_packed)]
    assert placed[0] == placed[1] and placed[1][0] == (("par", "par"), 1984)  # whole blocks before the last token's


@pytest.mark.parametrize("summary", [
    {"block_size": 16, "packed_hashes": "not base64!"},
    {"block_size": 16, "packed_hashes": "AAAA"},  # 3 bytes: not whole 8-byte hashes
    {"block_size": 16, "packed_hashes": "AAAAAAAAAAA=", "hashes": ["00000000000000ff"]},
    {"block_size": 16, "packed_hashes": "A" * 200_000},  # more than the cap of hashes
    {"block_size": 16, "packed_hashes": 7},
], ids=["not_base64", "partial_hash", "both_shapes", "over_the_cap", "not_a_string"])
def test_a_site_with_malformed_packed_hashes_is_left_out_and_logged(summary, caplog, request):
    caplog.set_level(logging.WARNING, logger="router.snapshot")
    name = f"bad-{request.node.callspec.id}"  # one log line per site and minute: a name of its own
    parsed = parse_snapshot(document(site("par", PARIS), site(name, PARIS, prefix_cache_summary=summary),
                                     site("lyo", LYON)))
    assert [s.name for s in parsed.sites] == ["par", "lyo"]
    assert any(f"'{name}'" in r.getMessage() and "prefix_cache_summary" in r.getMessage() for r in caplog.records)


def registry(answers) -> RegistryClient:
    """A registry answering each poll with the next answer: (etag, body, content-encoding), or an exception
    to raise (the registry cannot be reached)."""
    polls = iter(answers)

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers["accept"].startswith(PACKED_SNAPSHOT_MEDIA_TYPE)  # the router asks for it
        reply = next(polls)
        if isinstance(reply, Exception):
            raise reply
        etag, body, encoding = reply
        headers = {"etag": etag, "content-type": "application/json"}
        if encoding:
            headers["content-encoding"] = encoding
        return httpx.Response(200, headers=headers, stream=Wire(body))

    return RegistryClient("http://registry:8500", "t", transport=httpx.MockTransport(answer))


async def test_a_body_that_does_not_decode_is_bad_encoding_not_unreachable(caplog):
    refused = httpx.ConnectError("connection refused")
    async with registry([("e1", zlib.compress(PLAIN), "deflate"),
                         ("e2", corrupted(zlib.compress(PLAIN)), "deflate"),  # deflate data that does not inflate
                         ("e3", b"<html>502 Bad Gateway</html>", None),      # a 200 whose body is no JSON
                         ("e4", zlib.compress(b'{"version": "7", "sites": ['), "deflate"),  # JSON cut short
                         refused,
                         ("e5", PLAIN, None)]) as client:
        feed = SnapshotFeed(client.snapshot, refresh_s=60.0)
        assert await feed.refresh() and feed.status().registry == REGISTRY_OK
        caplog.set_level(logging.WARNING, logger="router.snapshot_feed")
        for expected in ("not valid deflate data", "JSONDecodeError", "JSONDecodeError"):
            assert not await feed.refresh()
            status = feed.status()
            # The registry is up and its answer is broken: named as such, logged as an error, and the
            # router keeps placing with its last good view (every router gets the same body).
            assert (status.registry, status.view, status.healthy) == (REGISTRY_BAD_ENCODING, "last_good", True)
            assert expected in status.last_error and "does not decode" in status.last_error
            assert sorted(s.name for s in feed.current().sites) == ["ber", "par"]
        # Logged as an error, once for the streak in that state.
        assert [(r.levelno, "does not decode" in r.getMessage()) for r in caplog.records] == [(logging.ERROR, True)]
        assert not await feed.refresh()
        assert feed.status().registry == REGISTRY_UNREACHABLE and "unreachable" in feed.status().last_error
        assert await feed.refresh() and feed.status().registry == REGISTRY_OK


async def test_a_body_in_no_text_encoding_is_bad_encoding():
    async with registry([("e1", PLAIN, None), ("e2", b"\xff\xfe\x00\xd8 not json", None)]) as client:
        feed = SnapshotFeed(client.snapshot, refresh_s=60.0)
        assert await feed.refresh()
        assert not await feed.refresh()
    assert feed.status().body()["registry"] == "bad_encoding"
