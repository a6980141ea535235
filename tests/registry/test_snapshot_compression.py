"""The routers' snapshot compressed on the wire: a router that accepts `deflate` (httpx does by default)
gets the same snapshot in far fewer bytes, under its own ETag, with 304s for it; a client that accepts no
compression gets the plain JSON, as before."""

from __future__ import annotations

import json
import random
import zlib

import httpx
import pytest

from registry.client import RegistryClient
from registry.records import LinkMeasurement, ModelServed, SiteSpec
from registry.routes_router import accepts_deflate
from registry.snapshot_cache import SnapshotCache
from registry.wire import PrefixCacheSummary

from .conftest import ROUTER_TOKEN, capacity

ROUTER = {"Authorization": f"Bearer {ROUTER_TOKEN}"}


def add_site(store, name: str) -> int:
    store.sites.create(name, SiteSpec("eu-west", "DE", 50.1, 8.7, f"{name}:50051", ["prefill", "decode"],
                                      [ModelServed("llama", "both")], heartbeat_interval_s=2.0), "alice")
    return store.access.site_for_token(store.access.issue_site_token(name, "alice")).site_id


def fleet(store, num_sites: int, num_hashes, seed: int = 7) -> list[int]:
    """Sites reporting random 64-bit prefix-cache hashes, `num_hashes(i)` for the i-th (0: no summary)."""
    rng = random.Random(seed)
    ids = [add_site(store, f"site-{i:03d}") for i in range(num_sites)]
    for i, site_id in enumerate(ids):
        hashes = [f"{rng.getrandbits(64):016x}" for _ in range(num_hashes(i))]
        summary = PrefixCacheSummary(block_size=16, hashes=hashes) if hashes else None
        store.telemetry.record_heartbeat(site_id, capacity(40000, rng.randint(0, 40000), 16,
                                                           num_running=rng.randint(0, 60),
                                                           prefix_cache_summary=summary))
    return ids


def test_deflated_snapshot_inflates_to_the_plain_one(store, clock):
    """Sites that never reported (first and last), links, and every change since: the zlib stream (its
    checksum included) holds exactly the plain body's bytes at the same moment."""
    ids = fleet(store, 4, lambda i: 500 * i)
    add_site(store, "aaa-never")
    add_site(store, "zzz-never")
    store.telemetry.record_links(ids[0], [LinkMeasurement("site-001", 12.5, 900.0)])
    cache = SnapshotCache(store.engine, clock=clock)
    for change in range(4):
        deflated, plain = cache.get(deflate=True), cache.get()
        assert deflated.encoding == "deflate" and plain.encoding is None
        assert deflated.etag == plain.etag.removesuffix('"') + '-deflate"'
        assert zlib.decompress(deflated.body) == plain.body
        assert len(json.loads(plain.body)["sites"]) == 6 and json.loads(plain.body)["links"]
        store.telemetry.record_heartbeat(ids[change], capacity(100, change, 16))
        clock.advance(0.5)


def test_fragments_are_compressed_once(store, clock, monkeypatch):
    """A render after one site's heartbeat compresses that site's new capacity only, not the fleet."""
    ids = fleet(store, 6, lambda i: 200)
    cache = SnapshotCache(store.engine, clock=clock, max_body_age_s=0.0)
    cache.get(deflate=True)
    compressed = []
    real = zlib.compressobj
    monkeypatch.setattr(zlib, "compressobj", lambda *args: compressed.append(1) or real(*args))
    clock.advance(0.1)
    cache.get(deflate=True)
    assert compressed == []  # only the ages moved
    store.telemetry.record_heartbeat(ids[2], capacity(100, 7, 16))
    assert zlib.decompress(cache.get(deflate=True).body) == cache.get().body
    assert len(compressed) == 1


@pytest.mark.parametrize(("header", "accepted"), [
    ("gzip, deflate", True), ("gzip, deflate, br, zstd", True), ("DEFLATE;q=0.5", True), ("*", True),
    (None, False), ("", False), ("identity", False), ("gzip", False), ("deflate;q=0", False),
    ("gzip, deflate;q=0, *", False), ("deflate;q=oops", False),
])
def test_accept_encoding(header, accepted):
    assert accepts_deflate(header) is accepted


async def test_router_poll_over_http_compressed_and_plain(store, live_server):
    """Over a real HTTP server: a client that accepts deflate (httpx: Accept-Encoding: gzip, deflate) gets the
    same snapshot as a client that accepts no compression, in under 65% of the bytes for a fleet whose big sites
    report thousands of prefix-cache hashes; each answer's ETag gets a 304 for the same encoding, and the body
    (not a 304) for the other."""
    fleet(store, 40, lambda i: 3000 if i % 5 == 0 else i % 4)
    async with RegistryClient(live_server, ROUTER_TOKEN) as router, \
            httpx.AsyncClient(base_url=live_server, headers=ROUTER) as http:
        compressed = await http.get("/v1/router/snapshot")
        plain = await http.get("/v1/router/snapshot", headers={"Accept-Encoding": "identity"})
        assert compressed.headers["content-encoding"] == "deflate" and "content-encoding" not in plain.headers
        assert compressed.headers["vary"] == plain.headers["vary"] == "Accept, Accept-Encoding"
        assert compressed.json() == plain.json() == json.loads(plain.content)
        # Random 64-bit hashes in hex carry 8 bytes of information in 19: about 54% is what deflate reaches.
        assert compressed.num_bytes_downloaded < 0.65 * plain.num_bytes_downloaded
        snapshot, etag = await router.snapshot(packed=False)
        assert snapshot == plain.json() and etag == compressed.headers["etag"] != plain.headers["etag"]
        assert await router.snapshot(etag, packed=False) == (None, etag)
        for held, encoding, status in [(etag, "identity", 200), (plain.headers["etag"], "identity", 304),
                                       (plain.headers["etag"], "deflate", 200), (etag, "deflate", 304)]:
            again = await http.get("/v1/router/snapshot", headers={"If-None-Match": held, "Accept-Encoding": encoding})
            assert again.status_code == status, (held, encoding)
            assert again.headers["etag"] == (etag if encoding == "deflate" else plain.headers["etag"])
            assert (again.content == b"") if status == 304 else (again.json() == plain.json())


async def test_client_without_accept_encoding_gets_plain_json(admin, connect, raw):
    """An older client, or a tool that sends no Accept-Encoding at all, reads the JSON as it always did."""
    await admin.create_site("fra-1", region="eu-west")
    request = raw.build_request("GET", "/v1/router/snapshot", headers=ROUTER)
    del request.headers["accept-encoding"]
    response = await raw.send(request)
    assert response.status_code == 200 and "content-encoding" not in response.headers
    assert response.headers["content-type"] == "application/json"
    assert json.loads(response.content)["sites"][0]["name"] == "fra-1"
