"""A key admitted provisionally on a router (router/rate_limit.py) has its grant request go out at once, not
at the reporter's next interval (router/fleet_reporter.py): the registry hears of the key, and the router
gets its grant, a round trip after the key's first request. Such wake-ups coalesce into one report."""

from __future__ import annotations

import asyncio

from tests.router.conftest import ROUTER_TOKEN
from router.fleet_reporter import FleetReporter, UsageMeter
from router.rate_limit import Charge, RateLimiter

INTERVAL_S = 60.0   # far longer than the test waits: only an early report can reach the registry in time
WAIT_S = 10.0
LIMIT = 800          # requests per minute


class RecordingRegistry:
    """The registry's real fleet-report endpoint; every report it answered, with its answer."""

    def __init__(self, client) -> None:
        self._client = client
        self.answered: list[tuple[dict, dict]] = []

    async def send(self, body: dict) -> dict:
        answer = await self._client.fleet_report(body)
        self.answered.append((body, answer))
        return answer

    def reports_charging(self, key_id: int) -> list[tuple[dict, dict]]:
        return [(body, answer) for body, answer in self.answered
                if any(charge["key_id"] == key_id for charge in body["charges"])]

    async def wait_for_charge(self, key_id: int) -> tuple[dict, dict]:
        async with asyncio.timeout(WAIT_S):
            while not (found := self.reports_charging(key_id)):
                await asyncio.sleep(0.01)
        return found[0]


async def limited_key(cluster, name: str) -> int:
    return (await cluster.admin.create_api_key(name, requests_per_minute=LIMIT))["id"]


async def started_reporter(cluster) -> tuple[FleetReporter, RecordingRegistry]:
    """A reporter on a long interval that has had its first answer (a key's request asked for a grant)."""
    registry = RecordingRegistry(cluster.client(ROUTER_TOKEN))
    reporter = FleetReporter(registry.send, RateLimiter(report_interval_s=INTERVAL_S), UsageMeter(), "r1",
                             interval_s=INTERVAL_S)
    reporter.start()
    first_key = await limited_key(cluster, "first")
    # No answer yet, so no allowance: this request asks, and the answer to that report admits it.
    assert isinstance(await reporter.admit(first_key, LIMIT, None, 1), Charge)
    assert reporter.limiter.num_provisional_admissions == 0 and len(registry.answered) == 1
    return reporter, registry


async def test_a_provisional_admission_sends_its_grant_request_at_once(cluster):
    reporter, registry = await started_reporter(cluster)
    try:
        key_id = await limited_key(cluster, "new")
        assert isinstance(await reporter.admit(key_id, LIMIT, None, 1), Charge)
        assert reporter.limiter.num_provisional_admissions == 1   # admitted with no round trip
        body, answer = await registry.wait_for_charge(key_id)
        assert [d["key_id"] for d in body["demand"] if d["key_id"] == key_id] == [key_id]
        assert [g["key_id"] for g in answer["grants"] if g["key_id"] == key_id] == [key_id]
        # With the grant in, the key's next request spends it: no allowance, no early report.
        reports = len(registry.answered)
        assert isinstance(await reporter.admit(key_id, LIMIT, None, 1), Charge)
        assert reporter.limiter.num_provisional_admissions == 1
        await asyncio.sleep(0.2)
        assert len(registry.answered) == reports
    finally:
        await reporter.stop()


async def test_many_new_keys_at_once_share_one_early_report(cluster):
    reporter, registry = await started_reporter(cluster)
    try:
        key_ids = [await limited_key(cluster, f"burst-{i}") for i in range(20)]
        for key_id in key_ids:
            for _ in range(3):   # several requests of each before the report goes out
                assert isinstance(await reporter.admit(key_id, LIMIT, None, 1), Charge)
        assert reporter.limiter.num_provisional_admissions == 60
        body, answer = await registry.wait_for_charge(key_ids[0])
        assert {d["key_id"] for d in body["demand"]} >= set(key_ids)
        assert {g["key_id"] for g in answer["grants"]} >= set(key_ids)
        await asyncio.sleep(0.2)
        assert len(registry.answered) == 2   # the first answer, and the one early report for all of them
    finally:
        await reporter.stop()
