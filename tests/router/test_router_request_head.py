"""Issue 17, defect 4 (router): request heads are bounded in size, count and time (431/408)
before any authentication, on the router's own server (Router.start_server)."""

from __future__ import annotations

from registry.http_head import HeadLimitedHttp
from tests.request_head import assert_head_limits


async def test_request_head_limits(make_router, monkeypatch):
    monkeypatch.setattr(HeadLimitedHttp, "head_timeout_s", 0.5)
    _router, url = await make_router(require_api_key=True)
    await assert_head_limits(int(url.rsplit(":", 1)[1]))
