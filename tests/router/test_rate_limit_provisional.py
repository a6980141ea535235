"""A key's first request on a router does not wait for the registry (router/rate_limit.py, provisional
allowance): it is admitted while the router's own charges of the key stay within limit ÷ (8 n); the
grant request goes out in the report beside it, and an answer that says the key is over its limit
is obeyed from then on, even after the key went idle. N routers' allowances stay within the bound
registry/allowance.py documents (L / 8 over the limit)."""

from __future__ import annotations

import asyncio

from registry.allowance import PROVISIONAL_SPLIT, provisional_allowance
from registry.fleet import KeyGrant, LimitGrant, ReportResult
from router.fleet_reporter import FleetReporter, UsageMeter
from router.rate_limit import IDLE_RELEASE_S, Charge, RateLimiter, Refusal

KEY_ID = 7
LIMIT = 160_000           # tokens per minute: a provisional allowance of 10,000 on each of two routers
LIVE_ROUTERS = 2
RESET_S = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def answer(body: dict, free: int) -> dict:
    """The registry's answer: each key in the report's demand has `free` tokens left in its window
    (0: over its limit, granted nothing)."""
    grants = [KeyGrant(d["key_id"], None, LimitGrant(min(free, 20_000), free, free // 2, RESET_S))
              for d in body["demand"]]
    return ReportResult(True, grants, live_routers=LIVE_ROUTERS).to_json()


async def test_a_keys_first_request_is_answered_while_the_registry_is_slow_and_its_verdict_then_holds():
    clock, registry_slow, bodies = Clock(), asyncio.Event(), []
    room = [LIMIT]

    async def send(body: dict) -> dict:
        bodies.append(body)
        if body["demand"]:
            await registry_slow.wait()   # the grant endpoint answers only when the test lets it
        return answer(body, room[0])

    limiter = RateLimiter(clock=clock, wall=clock, report_interval_s=60.0)
    reporter = FleetReporter(send, limiter, UsageMeter(), interval_s=60.0, clock=clock, ask_timeout_s=0.5)
    assert await reporter.report_once()   # the router's first answer: two routers share every limit

    # The key's first requests here: admitted on the provisional allowance, the registry not asked.
    first = await reporter.admit(KEY_ID, None, LIMIT, 6000)
    report = asyncio.create_task(reporter.report_once())   # the grant request, out in the background
    await asyncio.sleep(0)
    second = await reporter.admit(KEY_ID, None, LIMIT, 4000)
    assert isinstance(first, Charge) and isinstance(second, Charge)
    assert reporter.num_reports == 1 and not report.done()   # no answer about the key has come
    assert limiter.num_provisional_admissions == 2
    # The allowance (10,000 tokens here) is spent: the next request asks the registry after all.
    over_allowance = limiter.admit(KEY_ID, None, LIMIT, 1000)
    assert isinstance(over_allowance, Refusal) and over_allowance.ask

    # The registry answers: the key is over its limit (another router used the window). Refused from then on.
    room[0] = 0
    registry_slow.set()
    assert await report
    assert [(d["key_id"], d["tokens"]) for d in bodies[1]["demand"]] == [(KEY_ID, 6000)]
    assert [(c["key_id"], c["tokens"]) for c in bodies[1]["charges"]] == [(KEY_ID, 6000)]
    refused = await reporter.admit(KEY_ID, None, LIMIT, 100)
    assert isinstance(refused, Refusal) and refused.limit == "tokens"
    # Idle long enough to give the key back: its next request is still refused, not admitted anew.
    clock.now += IDLE_RELEASE_S + 1
    assert await reporter.report_once()
    assert limiter.status()["limited_keys"] == 0
    assert isinstance(limiter.admit(KEY_ID, None, LIMIT, 100), Refusal)
    assert limiter.num_provisional_admissions == 2
    await reporter.stop()


def granted_once(clock: Clock, live_routers: int) -> RateLimiter:
    """A router that has had one answer (about no key) from a registry counting `live_routers`."""
    limiter = RateLimiter(clock=clock, wall=clock)
    part = limiter.take_report()
    limiter.answered(part.seq, clock(), ReportResult(True, [], live_routers=live_routers).to_json())
    return limiter


def test_n_routers_provisional_admissions_stay_within_the_documented_bound():
    # Eight routers, a key limited to 800 requests a minute, clients hammering every router while the
    # registry never answers about the key: each admits its allowance and no more, in any window, even
    # when the key goes idle and comes back (given back, then asked for again).
    clock, num_routers, limit = Clock(), 8, 800
    routers = [granted_once(clock, num_routers) for _ in range(num_routers)]
    admitted = 0
    for _ in range(3):   # three idle cycles within one minute
        for limiter in routers:
            admitted += sum(isinstance(limiter.admit(KEY_ID, limit, None, 1), Charge) for _ in range(100))
        clock.now += IDLE_RELEASE_S + 1
        for limiter in routers:
            limiter.take_report()   # the key is given back idle: no grant on any router
    assert admitted == num_routers * provisional_allowance(limit, num_routers)
    assert admitted <= limit // PROVISIONAL_SPLIT
    # A minute later the window has moved on: the allowance is there again.
    clock.now += 60
    assert isinstance(routers[0].admit(KEY_ID, limit, None, 1), Charge)


def test_no_allowance_before_the_first_answer_nor_for_a_request_larger_than_it():
    clock = Clock()
    fresh = RateLimiter(clock=clock, wall=clock)   # it does not know yet how many routers share a limit
    assert isinstance(fresh.admit(KEY_ID, None, LIMIT, 10), Refusal)
    limiter = granted_once(clock, LIVE_ROUTERS)
    assert isinstance(limiter.admit(KEY_ID, None, LIMIT, provisional_allowance(LIMIT, LIVE_ROUTERS) + 1), Refusal)
    assert isinstance(limiter.admit(KEY_ID, None, LIMIT, provisional_allowance(LIMIT, LIVE_ROUTERS)), Charge)
    # A limit too small to share out this way gives no allowance: the key waits for its grant as before.
    assert isinstance(limiter.admit(KEY_ID + 1, 5, None, 1), Refusal)
