"""The router's snapshot poll against a registry that compresses: the async client inflates the body on
a worker thread, never on the event loop that relays the router's streams, and gets exactly the snapshot
a client that accepts no compression reads (in the format it asked for); the command-line client keeps
httpx's own inflating."""

from __future__ import annotations

import threading
import zlib

import httpx

from registry.client import RegistryClient, SyncRegistryClient

from registry.wire import PACKED_SNAPSHOT_MEDIA_TYPE

from .conftest import ROUTER_TOKEN
from .test_snapshot_compression import ROUTER, fleet


def record_inflating_threads(monkeypatch) -> list[int]:
    """The threads that inflate anything from now on (zlib is what httpx's deflate decoder uses, too)."""
    threads = []
    real_decompress, real_decompressobj = zlib.decompress, zlib.decompressobj

    def decompress(*args, **kwargs):
        threads.append(threading.get_ident())
        return real_decompress(*args, **kwargs)

    def decompressobj(*args, **kwargs):
        threads.append(threading.get_ident())
        return real_decompressobj(*args, **kwargs)

    monkeypatch.setattr(zlib, "decompress", decompress)
    monkeypatch.setattr(zlib, "decompressobj", decompressobj)
    return threads


async def test_the_router_inflates_the_snapshot_off_the_event_loop(store, live_server, monkeypatch):
    fleet(store, 12, lambda i: 300 if i % 3 == 0 else 0)
    async with httpx.AsyncClient(base_url=live_server, headers=ROUTER) as http:
        plain = await http.get("/v1/router/snapshot", headers={"Accept-Encoding": "identity",
                                                                "Accept": PACKED_SNAPSHOT_MEDIA_TYPE})
    assert "content-encoding" not in plain.headers
    inflating = record_inflating_threads(monkeypatch)
    async with RegistryClient(live_server, ROUTER_TOKEN) as router:
        snapshot, etag = await router.snapshot()
        assert snapshot == plain.json() and etag == plain.headers["etag"].removesuffix('"') + '-deflate"'
        assert inflating, "the registry sent the snapshot uncompressed: nothing was inflated"
        assert threading.get_ident() not in inflating
        assert await router.snapshot(etag) == (None, etag)


def test_the_command_line_client_reads_the_compressed_snapshot(store, live_server):
    fleet(store, 4, lambda i: 50)
    with SyncRegistryClient(live_server, ROUTER_TOKEN) as cli:
        snapshot, etag = cli.snapshot(packed=False)
        plain = httpx.get(live_server + "/v1/router/snapshot", headers={**ROUTER, "Accept-Encoding": "identity"})
        assert snapshot == plain.json() and etag == plain.headers["etag"].removesuffix('"') + '-deflate"'
        assert cli.snapshot(etag, packed=False) == (None, etag)
