"""Issue 17, defect 4 (router): request heads are bounded in size, count and time (431/408)
before any authentication, on the router's own server (Router.start_server)."""

from __future__ import annotations

from registry.http_head import HeadLimitedHttp
from tests.request_head import assert_body_deadline, assert_head_limits


async def test_request_head_limits(make_router, monkeypatch):
    monkeypatch.setattr(HeadLimitedHttp, "head_timeout_s", 0.5)
    _router, url = await make_router(require_api_key=True)
    await assert_head_limits(int(url.rsplit(":", 1)[1]))


async def test_request_body_deadline(make_router, monkeypatch):
    monkeypatch.setattr(HeadLimitedHttp, "body_timeout_s", 0.5)
    router, url = await make_router()
    await assert_body_deadline(int(url.rsplit(":", 1)[1]), b"/v1/chat/completions")
    assert router.metrics.requests_running._value.get() == 0  # the refused requests' handlers ended
