"""A fleet report the registry refuses (router/fleet_reporter.py) does not take the keys' demand with it:
refused for its content, it goes out again at once, under the same number, without the part at fault, so
a new key gets its grant a round trip later rather than a report interval later, and what the registry
took is counted once. Refused for the router itself, its askers get their answer at once."""

from __future__ import annotations

import asyncio

from registry.client import RegistryError
from router.fleet_reporter import FleetReporter, UsageMeter
from router.rate_limit import Charge, RateLimiter, Refusal
from tests.router.conftest import ROUTER_TOKEN

INTERVAL_S = 60.0   # far longer than the test waits: only an early report can reach the registry in time
WAIT_S = 10.0
LIMIT = 800          # requests per minute
TOO_LONG_MODEL = "m" * 201   # the registry takes model ids of up to 200 characters


class RefusingRegistry:
    """The registry's real fleet-report endpoint, each body passed through `alter` first; every attempt
    with its answer, or with the registry's refusal."""

    def __init__(self, client, alter=lambda body: body) -> None:
        self._client = client
        self._alter = alter
        self.attempts: list[tuple[dict, dict | RegistryError]] = []

    async def send(self, body: dict) -> dict:
        try:
            answer = await self._client.fleet_report(self._alter(body))
        except RegistryError as exc:
            self.attempts.append((body, exc))
            raise
        self.attempts.append((body, answer))
        return answer

    def refused(self) -> list[tuple[dict, RegistryError]]:
        return [(body, result) for body, result in self.attempts if isinstance(result, RegistryError)]

    async def grant_of(self, key_id: int) -> tuple[dict, dict]:
        """The first answered report with a grant for the key, and that grant."""
        async with asyncio.timeout(WAIT_S):
            while True:
                for body, answer in self.attempts:
                    if isinstance(answer, dict):
                        for grant in answer["grants"]:
                            if grant["key_id"] == key_id:
                                return body, grant
                await asyncio.sleep(0.01)


async def limited_key(cluster, name: str) -> int:
    return (await cluster.admin.create_api_key(name, requests_per_minute=LIMIT))["id"]


async def started_reporter(cluster, registry: RefusingRegistry) -> FleetReporter:
    """A reporter on a long interval that has had its first answer (so a new key gets an allowance)."""
    reporter = FleetReporter(registry.send, RateLimiter(report_interval_s=INTERVAL_S), UsageMeter(), "r1",
                             interval_s=INTERVAL_S, ask_timeout_s=INTERVAL_S)
    reporter.start()
    assert isinstance(await reporter.admit(await limited_key(cluster, "first"), LIMIT, None, 1), Charge)
    return reporter


async def test_a_report_refused_for_its_usage_still_brings_a_new_keys_grant(cluster):
    registry = RefusingRegistry(cluster.client(ROUTER_TOKEN))
    reporter = await started_reporter(cluster, registry)
    try:
        key_id = await limited_key(cluster, "new")
        reporter.meter.record(key_id, TOO_LONG_MODEL, 10, 0, 5)   # a usage row the registry refuses
        assert isinstance(await reporter.admit(key_id, LIMIT, None, 1), Charge)
        assert reporter.limiter.num_provisional_admissions == 1
        body, grant = await registry.grant_of(key_id)
        [(refused_body, refusal)] = registry.refused()
        assert refusal.status == 422 and "usage" in refusal.message
        # The same report, its usage left out: the charge and the demand went through.
        assert body["seq"] == refused_body["seq"] and body["usage"] == [] and refused_body["usage"]
        assert body["charges"] == refused_body["charges"] and body["demand"] == refused_body["demand"]
        assert grant["requests"]["free"] == LIMIT - 1
        # The grant is in: the key's next request spends it, no allowance; that charge is counted once more.
        assert isinstance(await reporter.admit(key_id, LIMIT, None, 1), Charge)
        assert reporter.limiter.num_provisional_admissions == 1
        assert await reporter.ask(WAIT_S)
        [grant] = [g for g in registry.attempts[-1][1]["grants"] if g["key_id"] == key_id]
        assert grant["requests"]["free"] == LIMIT - 2
        assert (await cluster.admin.usage(key_id=key_id))["items"] == []
    finally:
        await reporter.stop()


async def test_a_report_refused_for_its_charges_still_brings_the_grant(cluster):
    def unknown_charge_field(body: dict) -> dict:   # as a registry older than the router would refuse
        return {**body, "charges": [{**charge, "cost": 1} for charge in body["charges"]]}

    registry = RefusingRegistry(cluster.client(ROUTER_TOKEN))
    reporter = await started_reporter(cluster, registry)
    registry._alter = unknown_charge_field
    try:
        key_id = await limited_key(cluster, "new")
        reporter.meter.record(key_id, "tiny", 10, 0, 5)
        assert isinstance(await reporter.admit(key_id, LIMIT, None, 1), Charge)
        body, grant = await registry.grant_of(key_id)
        # Refused with its usage, then without: the demand alone went through.
        assert [(bool(b["usage"]), bool(b["charges"])) for b, _ in registry.refused()] == [(True, True), (False, True)]
        assert body["usage"] == body["charges"] == [] and key_id in [d["key_id"] for d in body["demand"]]
        assert grant["requests"]["free"] == LIMIT   # the dropped charge is not in the registry's window
        assert isinstance(await reporter.admit(key_id, LIMIT, None, 1), Charge)
        assert reporter.limiter.num_provisional_admissions == 1
    finally:
        await reporter.stop()


async def test_askers_of_a_report_refused_for_the_router_are_answered_at_once(cluster):
    registry = RefusingRegistry(cluster.client("not-the-router-token"))
    reporter = FleetReporter(registry.send, RateLimiter(report_interval_s=INTERVAL_S), UsageMeter(), "r1",
                             interval_s=INTERVAL_S, ask_timeout_s=INTERVAL_S)
    reporter.start()
    try:
        async with asyncio.timeout(WAIT_S):   # not at the ask deadline, a minute away
            decision = await reporter.admit(await limited_key(cluster, "k"), LIMIT, None, 1)
        assert isinstance(decision, Refusal)
        [(_, refusal)] = registry.refused()   # sent once: no part of it could be taken
        assert refusal.status == 401
        assert reporter.status()["num_report_refusals"] == 1
    finally:
        await reporter.stop()
