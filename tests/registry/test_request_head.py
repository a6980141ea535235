"""Issue 17, defect 4 (registry): request heads are bounded in size, count and time (431/408)
before any authentication, on the server the registry runs (registry.http_head)."""

from __future__ import annotations

import pytest

from registry.http_head import HeadLimitedHttp
from tests.request_head import assert_body_deadline, assert_head_limits


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the limits act before any database work
async def test_request_head_limits(live_server, monkeypatch):
    monkeypatch.setattr(HeadLimitedHttp, "head_timeout_s", 0.5)
    await assert_head_limits(int(live_server.rsplit(":", 1)[1]))


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_request_body_deadline(live_server, monkeypatch):
    monkeypatch.setattr(HeadLimitedHttp, "body_timeout_s", 0.5)
    await assert_body_deadline(int(live_server.rsplit(":", 1)[1]), b"/v1/admin/sites")
