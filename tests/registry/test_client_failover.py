"""Registry replicas: a client given several URLs moves to the next replica when one fails, within the
same call, and resends only what cannot have been carried out twice (registry/client.py)."""

from __future__ import annotations

import httpx
import pytest

from registry.client import RegistryClient, Replicas, SyncRegistryClient, registry_urls
from registry.service import create_app

from .conftest import ADMIN_TOKEN, ROUTER_TOKEN

IDLE = {"kv_blocks_total": 8, "kv_blocks_free": 8, "block_size": 16}
URLS = ["http://registry-a", "http://registry-b"]


class ReplicaTransport(httpx.AsyncBaseTransport):
    """Routes by host to one app per replica; a replica can be made unreachable, slow to answer
    (ReadTimeout after the request reached it) or answer 503."""

    def __init__(self, apps: dict[str, object]) -> None:
        self.apps = {host: httpx.ASGITransport(app) for host, app in apps.items()}
        self.down: set[str] = set()
        self.cut_after_send: set[str] = set()
        self.unavailable: set[str] = set()
        self.calls: list[tuple[str, str, str]] = []   # (host, method, path) that reached a replica

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        self.calls.append((host, request.method, request.url.path))
        if host in self.unavailable:
            return httpx.Response(503, json={"error": {"message": "database away", "code": "database_unavailable"}})
        response = await self.apps[host].handle_async_request(request)
        if host in self.cut_after_send:
            await response.aread()
            raise httpx.ReadTimeout("no answer in time", request=request)
        return response


@pytest.fixture
async def replicas(db_url, store):
    """Two registry apps (replicas) over one database, behind one routing transport."""
    apps = {url.removeprefix("http://"): create_app(db_url, ADMIN_TOKEN, ROUTER_TOKEN, store=store) for url in URLS}
    contexts = [app.router.lifespan_context(app) for app in apps.values()]
    for context in contexts:
        await context.__aenter__()
    transport = ReplicaTransport(apps)
    yield transport
    for context in reversed(contexts):
        await context.__aexit__(None, None, None)


async def site_token(replicas: ReplicaTransport) -> str:
    async with RegistryClient(URLS, ADMIN_TOKEN, transport=replicas) as admin:
        await admin.create_site("fra-1", region="eu-west", country="DE", lat=50.1, lon=8.7)
        return (await admin.issue_site_token("fra-1"))["token"]


async def test_calls_move_to_the_next_replica_and_stay_there(replicas):
    token = await site_token(replicas)
    async with RegistryClient(URLS, token, transport=replicas) as agent, \
            RegistryClient(URLS, ROUTER_TOKEN, transport=replicas) as router:
        await agent.heartbeat(IDLE)
        _snapshot, etag = await router.snapshot()
        assert {host for host, _m, _p in replicas.calls} == {"registry-a"}
        replicas.down.add("registry-a")
        replicas.calls.clear()
        assert (await agent.heartbeat(IDLE))["state"] == "active"   # no error: replica b answered
        # The ETag replica a handed out is understood by replica b: unchanged is a 304 (or, if b's
        # view differs, a full body), never an error.
        document, etag_b = await router.snapshot(etag)
        assert document["sites"][0]["alive"] is True   # changed by the heartbeat: a full body from b
        assert [host for host, _m, _p in replicas.calls] == ["registry-b", "registry-b"]
        assert (agent.replicas.current, router.replicas.current) == ("http://registry-b", "http://registry-b")
        replicas.down.clear()   # a is back; the clients stay on b until b fails
        replicas.calls.clear()
        assert await router.snapshot(etag_b) == (None, etag_b)
        await agent.heartbeat(IDLE)
        assert {host for host, _m, _p in replicas.calls} == {"registry-b"}


async def test_a_snapshot_etag_from_one_replica_is_current_at_another(replicas):
    token = await site_token(replicas)
    async with RegistryClient(URLS, token, transport=replicas) as agent, \
            RegistryClient(URLS, ROUTER_TOKEN, transport=replicas) as router:
        await agent.heartbeat(IDLE)
        _snapshot, etag = await router.snapshot()
        replicas.down.add("registry-a")
        # Nothing changed since: replica b, over the same database, answers 304 to a's ETag.
        assert await router.snapshot(etag) == (None, etag)
        assert router.replicas.current == "http://registry-b"


async def test_a_replica_answering_503_is_passed_over(replicas):
    replicas.unavailable.add("registry-a")
    async with RegistryClient(URLS, ADMIN_TOKEN, transport=replicas) as admin:
        await admin.create_site("fra-1")
        assert [s["name"] for s in (await admin.list_sites())["items"]] == ["fra-1"]
    assert [host for host, method, _p in replicas.calls if method == "POST"] == ["registry-a", "registry-b"]


async def test_only_idempotent_calls_are_resent_after_the_request_left(replicas):
    async with RegistryClient(URLS, ADMIN_TOKEN, transport=replicas) as admin:
        await admin.create_site("fra-1")
        token = (await admin.issue_site_token("fra-1"))["token"]
        replicas.cut_after_send.add("registry-a")
        # Creating a site may have happened on a: sending it to b too could create it twice.
        with pytest.raises(httpx.ReadTimeout):
            await admin.create_site("fra-2")
    assert [p for host, m, p in replicas.calls if m == "POST" and p == "/v1/admin/sites"] == ["/v1/admin/sites"] * 2
    async with RegistryClient(URLS, token, transport=replicas) as agent:
        replicas.calls.clear()
        assert (await agent.heartbeat(IDLE))["state"] == "active"   # a heartbeat is idempotent: b answers
        assert [host for host, _m, _p in replicas.calls] == ["registry-a", "registry-b"]


async def test_when_every_replica_is_down_the_last_error_is_raised(replicas):
    replicas.down.update({"registry-a", "registry-b"})
    async with RegistryClient(URLS, ROUTER_TOKEN, transport=replicas) as router:
        with pytest.raises(httpx.ConnectError):
            await router.snapshot()


def test_resting_replicas_are_tried_last_and_come_back():
    clock = [0.0]
    replicas = Replicas("http://a, http://b,http://c", clock=lambda: clock[0])
    first = lambda: [r.url for r, _last in replicas.attempts()]  # noqa: E731
    assert first() == ["http://a", "http://b", "http://c"]
    a = replicas.attempts()[0][0]
    replicas.unreachable(a, httpx.ConnectError("refused"), last=False, idempotent=False)
    assert first() == ["http://b", "http://c", "http://a"]   # a rests; b is now the one to call first
    clock[0] += 0.3   # b fails later than a (rests of 0.5 s ± 20%): a is back sooner
    b = replicas.attempts()[0][0]
    replicas.unreachable(b, httpx.ConnectError("refused"), last=False, idempotent=False)
    assert first() == ["http://c", "http://a", "http://b"]   # both rest: the sooner back comes first
    clock[0] += 60.0
    assert first() == ["http://c", "http://a", "http://b"]   # rested enough: in order from the current one
    assert [last for _r, last in replicas.attempts()] == [False, False, True]


def test_sync_client_fails_over_too():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "registry-a":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"items": [], "next_cursor": None})

    with SyncRegistryClient(URLS, ADMIN_TOKEN, transport=httpx.MockTransport(handler)) as admin:
        assert admin.list_sites() == {"items": [], "next_cursor": None}
        assert admin.replicas.current == "http://registry-b"


def test_registry_url_settings():
    assert registry_urls("http://a:8500") == ["http://a:8500"]
    assert registry_urls("http://a:8500/, https://b:8500") == ["http://a:8500", "https://b:8500"]
    assert registry_urls(["http://a", "http://a", "http://b"]) == ["http://a", "http://b"]
    with pytest.raises(ValueError, match="must start with http"):
        registry_urls("registry-a:8500")
    with pytest.raises(ValueError, match="no registry URL"):
        registry_urls(" , ")
    with pytest.raises(ValueError, match=r"'http://\[::1' is malformed"):
        registry_urls("http://a:8500,http://[::1")  # httpx.InvalidURL is no ValueError: it escaped every caller
    for url in ("http://:8500", "http://a:99999"):
        with pytest.raises(ValueError, match="must name a host and a port in 1-65535"):
            registry_urls(url)


async def test_a_large_snapshot_is_decoded_the_same_off_the_event_loop():
    # A fleet of hundreds of sites answers with a document of about a megabyte; the asyncio client
    # decodes one that large on a worker thread. The router gets the same document and etag either way.
    from registry.client import THREAD_DECODE_BYTES

    big = {"version": "9", "generated_at": 1.0, "links": [],
           "sites": [{"name": f"site-{i}", "hashes": [f"{i:016x}"] * 64} for i in range(400)]}
    small = {"version": "8", "generated_at": 1.0, "links": [], "sites": []}
    bodies = iter([big, small])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=next(bodies), headers={"etag": "e"})

    async with RegistryClient(URLS[0], ROUTER_TOKEN, transport=httpx.MockTransport(handler)) as router:
        document, etag = await router.snapshot()
        assert len(httpx.Response(200, json=big).content) >= THREAD_DECODE_BYTES
        assert (document, etag) == (big, "e")
        assert await router.snapshot() == (small, "e")
