"""Issue 17, defect 4 (router): request heads are bounded in size, count and time (431/408)
before any authentication, on the router's own server (Router.start_server)."""

from __future__ import annotations

from registry.http_head import HeadLimitedHttp
from tests.request_head import assert_body_deadline, assert_head_limits


async def test_request_head_limits(make_router, monkeypatch):
    monkeypatch.setattr(HeadLimitedHttp, "head_timeout_s", 0.5)
    _router, url = await make_router(require_api_key=True)
    await assert_head_limits(int(url.rsplit(":", 1)[1]))


async def test_request_body_deadline(cluster, make_router, monkeypatch):
    monkeypatch.setattr(HeadLimitedHttp, "body_timeout_s", 0.5)
    key = await cluster.create_key()
    router, url = await make_router()
    await assert_body_deadline(int(url.rsplit(":", 1)[1]), b"/v1/chat/completions", f"Bearer {key}".encode())
    assert router.metrics.requests_running._value.get() == 0  # the refused requests' handlers ended


async def test_a_caller_without_a_key_gets_its_401_before_the_router_reads_its_body(make_router):
    """A stranger's body (up to max_body_bytes) is not read: the 401 comes with its head alone."""
    from tests.request_head import exchange

    _router, url = await make_router()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: edgefire\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000\r\n\r\n")
    answer = await exchange(int(url.rsplit(":", 1)[1]), [head], timeout_s=5.0)  # the body never comes
    assert answer.startswith(b"HTTP/1.1 401 "), answer
