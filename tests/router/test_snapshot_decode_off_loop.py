"""The router's snapshot feed over the registry client when the body comes deflated: a plain, a zlib and
a bare-deflate body give the same snapshot; a corrupt or cut-off deflated body is a clear RegistryError,
reported as a bad encoding (not an unreachable registry), and the router goes on placing with its last good
snapshot."""

from __future__ import annotations

import json
import zlib

import httpx
import pytest

from registry.client import RegistryClient, RegistryError
from router.snapshot_feed import REGISTRY_BAD_ENCODING, REGISTRY_OK, SnapshotFeed

from test_router_placement import PARIS, site
from test_router_snapshot import document


class Wire(httpx.AsyncByteStream):
    """A body as it comes off the network, still encoded (httpx.Response(content=...) would decode it)."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    async def __aiter__(self):
        yield self.body


def bare_deflate(body: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(body) + compressor.flush()


def corrupted(body: bytes) -> bytes:
    middle = len(body) // 2
    return body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1:]


def registry(answers: list[tuple[str, bytes, str | None]]) -> RegistryClient:
    """A registry answering each poll with the next (etag, body, content-encoding); 304 for a current ETag."""
    polls = iter(answers)

    def answer(request: httpx.Request) -> httpx.Response:
        etag, body, encoding = next(polls)
        if request.headers.get("if-none-match") == etag:
            return httpx.Response(304, headers={"etag": etag})
        headers = {"etag": etag, "content-type": "application/json"}
        if encoding:
            headers["content-encoding"] = encoding
        return httpx.Response(200, headers=headers, stream=Wire(body))

    return RegistryClient("http://registry:8500", "t", transport=httpx.MockTransport(answer))


PLAIN = json.dumps(document(site("par", PARIS), site("ber", PARIS))).encode()


@pytest.mark.parametrize("body, encoding", [(PLAIN, None), (zlib.compress(PLAIN), "deflate"),
                                            (bare_deflate(PLAIN), "deflate")], ids=["plain", "zlib", "bare"])
async def test_every_encoding_gives_the_plain_snapshot(body, encoding):
    async with registry([("e1", body, encoding), ("e1", body, encoding)]) as client:
        assert await client.snapshot() == (json.loads(PLAIN), "e1")
        assert await client.snapshot("e1") == (None, "e1")


@pytest.mark.parametrize("damage", [corrupted, lambda body: body[:-12]], ids=["corrupt", "cut_off"])
async def test_a_bad_deflated_snapshot_is_refused_and_the_last_good_one_kept(damage, caplog):
    good = zlib.compress(PLAIN)
    bad = damage(zlib.compress(json.dumps(document(site("lon", PARIS))).encode()))
    async with registry([("e1", good, "deflate"), ("e2", bad, "deflate"), ("e2", bad, "deflate")]) as client:
        feed = SnapshotFeed(client.snapshot, refresh_s=60.0)
        assert await feed.refresh() and feed.status().registry == REGISTRY_OK
        assert not await feed.refresh()
        assert feed.status().registry == REGISTRY_BAD_ENCODING
        assert sorted(s.name for s in feed.current().sites) == ["ber", "par"]
        assert "/v1/router/snapshot is not valid deflate data" in feed.status().last_error
        with pytest.raises(RegistryError) as err:
            await client.snapshot("e1")
    assert (err.value.status, err.value.code) == (200, "bad_encoding")
