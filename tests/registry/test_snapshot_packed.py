"""The routers' snapshot with prefix-cache hashes packed: a router that asks for the packed format (HTTP
Accept) gets every site and every hash the JSON format carries, in fewer bytes; a client that does not ask
gets the JSON byte for byte as before. Each representation (JSON or packed, plain or deflated) has its own
ETag, and a router holding one gets its 304. Both databases, over a real HTTP server."""

from __future__ import annotations

import base64
import json
import zlib

import httpx
import pytest

from registry import snapshot as registry_snapshot
from registry.client import RegistryClient
from registry.routes_router import accepts_packed
from registry.snapshot_cache import SnapshotCache
from registry.wire import PACKED_SNAPSHOT_MEDIA_TYPE, ModelCapacity, PrefixCacheSummary
from router.snapshot import parse_snapshot

from .conftest import ROUTER_TOKEN, capacity
from .test_snapshot_compression import ROUTER, add_site, fleet

PACKED = {"Accept": PACKED_SNAPSHOT_MEDIA_TYPE}


def unpacked(document: dict) -> dict:
    """A packed document with every summary's hashes written back as the JSON format's hex strings."""
    def summary(doc: dict | None) -> dict | None:
        if doc is None:
            return None
        raw = base64.b64decode(doc["packed_hashes"], validate=True)
        return {"block_size": doc["block_size"], "hashes": [raw[i:i + 8].hex() for i in range(0, len(raw), 8)]}

    document = json.loads(json.dumps(document))
    for site in document["sites"]:
        cap = site["capacity"]
        if cap is None:
            continue
        cap["prefix_cache_summary"] = summary(cap["prefix_cache_summary"])
        for own in (cap.get("models") or {}).values():
            own["prefix_cache_summary"] = summary(own["prefix_cache_summary"])
    return document


def placement_view(document: dict) -> list[tuple]:
    """What a router places with, per site, after parsing: the site, its figures and its cached hashes."""
    view = []
    for site in parse_snapshot(document).sites:
        cap = site.capacity
        figures = None if cap is None else (
            cap.model_dump(exclude={"prefix_cache_summary", "models"}), cap.cached_hashes, cap.cache_block_size,
            {model: (own.kv_blocks_free, own.cached_hashes, own.cache_block_size)
             for model, own in (cap.models or {}).items()})
        view.append((site.name, site.alive, site.state, site.models, site.offer, figures))
    return view


def mixed_fleet(store) -> None:
    """Big and small summaries, none, an empty one, a site hosting two models apart, one that never reported."""
    ids = fleet(store, 10, lambda i: 2500 if i % 4 == 0 else i % 3)
    store.telemetry.record_heartbeat(ids[1], capacity(100, 10, 16, prefix_cache_summary=PrefixCacheSummary(
        block_size=32, hashes=[])))
    own = {"llama": ModelCapacity(kv_blocks_total=50, kv_blocks_free=5, prefix_cache_summary=PrefixCacheSummary(
               block_size=16, hashes=["00000000000000ff", "ffffffffffffffff"])),
           "qwen": ModelCapacity(kv_blocks_total=50, kv_blocks_free=40)}
    store.telemetry.record_heartbeat(ids[2], capacity(100, 45, 16, models=own, prefix_cache_summary=PrefixCacheSummary(
        block_size=16, hashes=["0123456789abcdef"])))
    add_site(store, "zzz-never")


async def test_an_old_and_a_new_router_poll_read_the_same_snapshot(store, live_server):
    mixed_fleet(store)
    async with httpx.AsyncClient(base_url=live_server, headers=ROUTER) as http:
        for encoding in ("identity", "deflate"):
            old = await http.get("/v1/router/snapshot", headers={"Accept-Encoding": encoding})
            new = await http.get("/v1/router/snapshot", headers={"Accept-Encoding": encoding, **PACKED})
            assert old.headers["content-type"] == "application/json"
            assert new.headers["content-type"] == PACKED_SNAPSHOT_MEDIA_TYPE
            old_doc, new_doc = old.json(), new.json()
            assert "packed_hashes" in new.text and "packed_hashes" not in old.text
            # The same hashes in the same order, and everything else the same bytes' worth.
            assert unpacked(new_doc) == old_doc
            view = placement_view(old_doc)
            assert placement_view(new_doc) == view
            assert len(view) == 11 and sum(len(site[-1][1]) for site in view if site[-1]) == 3 * 2500 + 1 + 2 + 1
            multi = next(site for site in view if site[0] == "site-002")[-1]
            assert multi[3] == {"llama": (5, frozenset({0xFF, 2**64 - 1}), 16), "qwen": (40, frozenset(), 0)}
            # Random 64-bit hashes: 11 bytes each packed instead of 19 as hex strings.
            assert len(new.content) < (0.65 if encoding == "identity" else 0.85) * len(old.content)


async def test_the_routers_client_asks_for_the_packed_format_and_parses_it(store, live_server):
    mixed_fleet(store)
    async with RegistryClient(live_server, ROUTER_TOKEN) as router:
        new, etag = await router.snapshot()
        old, _ = await router.snapshot(packed=False)
        assert etag.endswith('-packed-deflate"') and unpacked(new) == old
        assert placement_view(new) == placement_view(old)
        assert await router.snapshot(etag) == (None, etag)


async def test_a_client_that_does_not_ask_gets_todays_json(store, live_server, clock):
    """`*/*` (httpx's default), `application/json`, a packed type it refuses (q=0) or ranks below JSON,
    or no Accept at all: the JSON format, the bytes the registry renders as it always did."""
    mixed_fleet(store)
    expected = store.snapshot().render(clock.now)
    async with httpx.AsyncClient(base_url=live_server, headers={**ROUTER, "Accept-Encoding": "identity"}) as http:
        for accept in ("*/*", "application/json", f"{PACKED_SNAPSHOT_MEDIA_TYPE};q=0, */*",
                       f"{PACKED_SNAPSHOT_MEDIA_TYPE};q=0.4, application/json", None):
            request = http.build_request("GET", "/v1/router/snapshot")
            if accept is None:
                del request.headers["accept"]
            else:
                request.headers["accept"] = accept
            response = await http.send(request)
            assert response.headers["content-type"] == "application/json", accept
            assert response.content == expected, accept


async def test_each_representation_has_its_own_etag_and_gets_its_304(store, live_server):
    ids = fleet(store, 6, lambda i: 40)
    representations = {"json": {"Accept-Encoding": "identity"}, "json+deflate": {"Accept-Encoding": "deflate"},
                       "packed": {"Accept-Encoding": "identity", **PACKED}, "packed+deflate": PACKED}
    async with httpx.AsyncClient(base_url=live_server, headers=ROUTER) as http:
        async def poll(kind: str, held: str | None = None) -> httpx.Response:
            headers = representations[kind] | ({"If-None-Match": held} if held else {})
            return await http.get("/v1/router/snapshot", headers=headers)

        etags = {kind: (await poll(kind)).headers["etag"] for kind in representations}
        assert len(set(etags.values())) == 4
        assert all(tag.startswith('"') and tag.endswith('"') for tag in etags.values())  # strong ETags
        for kind in representations:
            for held_kind, held in etags.items():
                answer = await poll(kind, held)
                if held_kind == kind:  # the representation the router holds is current: no body
                    assert (answer.status_code, answer.content, answer.headers["etag"]) == (304, b"", held)
                else:  # another one's ETag never stands in for this one
                    assert answer.status_code == 200 and answer.headers["etag"] == etags[kind], (kind, held_kind)
            # A cache holding several, or a weak comparison, still finds its own.
            assert (await poll(kind, f'"other", W/{etags[kind]}')).status_code == 304
        store.telemetry.record_heartbeat(ids[3], capacity(100, 3, 16))
        for kind in representations:
            changed = await poll(kind, etags[kind])
            assert changed.status_code == 200 and changed.headers["etag"] != etags[kind]


@pytest.mark.parametrize(("header", "packed"), [
    (PACKED_SNAPSHOT_MEDIA_TYPE, True), (f"{PACKED_SNAPSHOT_MEDIA_TYPE}, application/json;q=0.5", True),
    (f"application/json, {PACKED_SNAPSHOT_MEDIA_TYPE.upper()}", True), (f"{PACKED_SNAPSHOT_MEDIA_TYPE};q=0.9", True),
    (None, False), ("", False), ("*/*", False), ("application/json", False), ("application/*", False),
    (f"{PACKED_SNAPSHOT_MEDIA_TYPE};q=0", False), (f"{PACKED_SNAPSHOT_MEDIA_TYPE};q=0.5, */*", False),
    (f"{PACKED_SNAPSHOT_MEDIA_TYPE};q=oops", False),
])
def test_accept(header, packed):
    assert accepts_packed(header) is packed


def test_a_sites_capacity_is_packed_once_per_row(store, clock, monkeypatch):
    """A packed render after one site's heartbeat packs that site's new capacity only, in either coding, and
    the deflated packed body inflates to the plain packed one."""
    ids = fleet(store, 6, lambda i: 300)
    cache = SnapshotCache(store.engine, clock=clock, max_body_age_s=0.0)
    packs = []
    real = registry_snapshot.pack_cache_hashes
    monkeypatch.setattr(registry_snapshot, "pack_cache_hashes", lambda hashes: packs.append(1) or real(hashes))
    first = cache.get(packed=True)
    assert len(packs) == 6 and first.packed and first.encoding is None
    clock.advance(0.1)
    deflated = cache.get(packed=True, deflate=True)
    assert zlib.decompress(deflated.body) == cache.get(packed=True).body and len(packs) == 6
    store.telemetry.record_heartbeat(ids[2], capacity(100, 7, 16, prefix_cache_summary=PrefixCacheSummary(
        block_size=16, hashes=["00000000000000aa"])))
    cache.get(packed=True, deflate=True)
    cache.get(packed=True)
    assert len(packs) == 7
    assert unpacked(json.loads(cache.get(packed=True).body)) == json.loads(cache.get().body)
