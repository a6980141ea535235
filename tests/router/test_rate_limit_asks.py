"""A request that finds its key's budget short asks the registry for room (router/fleet_reporter.py):
while answers leave it short but say the key's window has unallocated room, it asks again rather than
get a 429 on a key far below its limit; with no answer it is refused once its deadline passes."""

from __future__ import annotations

import httpx

from registry.fleet import KeyGrant, LimitGrant, ReportResult
from router.fleet_reporter import FleetReporter, UsageMeter
from router.rate_limit import Charge, RateLimiter, Refusal

KEY_ID = 7
LIMIT = 10_000_000


def _answer(body: dict, grant: int) -> dict:
    """What the registry answers when it grants `grant` tokens with most of the window unallocated."""
    grants = [KeyGrant(d["key_id"], None, LimitGrant(grant, LIMIT, LIMIT // 2, 0.0)) for d in body["demand"]]
    return ReportResult(True, grants, live_routers=2).to_json()


async def test_a_request_an_answer_left_short_asks_again_while_the_key_has_room():
    # The first answer's grant went to other requests meanwhile (here: it is smaller than this one);
    # the key has almost its whole window left, so the request must not be refused.
    grants, bodies = [1000, 50_000], []

    async def send(body: dict) -> dict:
        bodies.append(body)
        return _answer(body, grants.pop(0) if grants else 0)

    reporter = FleetReporter(send, RateLimiter(report_interval_s=60.0), UsageMeter(), interval_s=60.0)
    reporter.start()
    try:
        decision = await reporter.admit(KEY_ID, None, LIMIT, 5000)
    finally:
        await reporter.stop()
    assert isinstance(decision, Charge)
    # Still waiting after the first answer, it was demand in the second report too.
    assert [d["tokens"] for b in bodies[:2] for d in b["demand"]] == [5000, 5000]


async def test_with_no_answer_a_request_is_refused_at_its_deadline():
    registry_up = False

    async def send(body: dict) -> dict:
        if not registry_up:
            raise httpx.ConnectError("the registry is down")
        return _answer(body, 0)

    reporter = FleetReporter(send, RateLimiter(report_interval_s=60.0), UsageMeter(), interval_s=60.0,
                             ask_timeout_s=0.3)
    reporter.start()
    try:
        decision = await reporter.admit(KEY_ID, None, LIMIT, 5000)
    finally:
        registry_up = True   # so the last report goes out at stop
        await reporter.stop()
    assert isinstance(decision, Refusal) and decision.limit == "tokens"
