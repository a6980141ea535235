"""This router's reports to the registry, about once a second: the usage it served per key, model and
hour, and its rate-limit charges per key and second; the answer brings its grants (router/rate_limit.py,
registry/allowance.py).

One report is in flight at a time and a report keeps its number (`seq`) until an answer comes: a
report whose answer was lost is sent again as it was, to whichever registry replica answers, and the
registry applies it once. Meanwhile new usage and charges wait for the next report. So a router that
crashes loses at most what it served since its last answered report (about a second while the
registry answers), and a clean stop sends a last report.

A report the registry refuses (4xx) cannot succeed by being sent again as it was. A refusal of its
content (a field the registry rejects, or a body over its size limit) goes out again at once, under
the same number, without its usage rows, and if refused again without its rate-limit charges too: the
keys' demand, which the router builds from its own counters, still reaches the registry, so a key
waiting for its grant gets it a round trip later rather than a report later, and its askers their
answer. The registry validates a report whole before applying any of it, so a refused report was not
applied, and the number applies at most once whichever body carries it: nothing is counted twice.
What is left out is logged with its figures and dropped. A refusal of the router itself (401, 403)
drops the report at once; its askers are answered (no grant) rather than left to their deadline.

An answer also names the reported keys the registry now holds revoked; `on_revoked` gets their ids
(the router's key cache refuses them from then on, router/api_keys.py).

`ask()` is for a request that found no room in its key's budget: it has the next report go out at
once (with that request's demand in it) and waits for its answer; concurrent askers share that
report. `admit()` asks again while an answer leaves the request short but the registry says the key
has unallocated room (other requests took what was granted meanwhile), all within `ask_timeout_s`.
That deadline is GRANT_TTL_S: the answer that brings a grant may come behind the report already in
flight, two round trips on a loaded registry, and a 429 for a key the registry has room for is what
the limit must not do; a grant answered later than that would have lapsed on arrival anyway.

A key admitted provisionally (router/rate_limit.py) before any report carried its demand has the next
report go out soon too (`report_soon`), without waiting for its answer: the grant that replaces the
allowance then comes a round trip after the key's first request, not up to `interval_s` after. Such
wake-ups coalesce: reports go out one at a time, so however many keys arrive, at most one report
follows the one in flight, and never within MIN_GAP_S of the previous start. While reports fail,
the backoff alone paces them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from registry.allowance import GRANT_TTL_S
from registry.client import RegistryError
from registry.fleet import UsageCount
from registry.retry import Backoff
from router.rate_limit import Charge, RateLimiter, Refusal

log = logging.getLogger(__name__)

MIN_GAP_S = 0.05          # early reports are at least this far apart
STOP_FLUSH_TIMEOUT_S = 3.0
MAX_REPORT_USAGE = 2000   # usage rows per report; the rest wait for the next (router/rate_limit.py says why)
USAGE_COUNTS = ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")
# Refusals of a report's content (400: invalid input, 413: too large, 422: a field at fault): the parts
# the router builds from its own counters may still be taken. In the order they are left out:
CONTENT_REFUSALS = (400, 413, 422)
NARROWED_PARTS = {"usage": "usage row(s)", "charges": "rate-limit charge(s)"}


class UsageMeter:
    """What this router served, per key, model and hour, until it goes out in a report."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self._wall = wall
        self._counts: dict[tuple[int, str, int], list[int]] = {}

    def record(self, key_id: int, model: str, num_prompt_tokens: int, num_cached_tokens: int,
               num_completion_tokens: int) -> None:
        hour = math.floor(self._wall()) // 3600 * 3600
        counts = self._counts.setdefault((key_id, model, hour), [0, 0, 0, 0])
        counts[0] += 1
        counts[1] += num_prompt_tokens
        counts[2] += num_cached_tokens
        counts[3] += num_completion_tokens

    def take(self, limit: int) -> list[UsageCount]:
        """Up to `limit` rows, the oldest hours first; the rest stay for the next take."""
        rows = sorted(self._counts.items(), key=lambda item: (item[0][2], item[0][0], item[0][1]))
        self._counts = dict(rows[limit:])
        return [UsageCount(key_id, model, hour, *values) for (key_id, model, hour), values in rows[:limit]]


@dataclass(slots=True)
class _Report:
    seq: int
    body: dict
    num_requests: int                   # served requests it carries (for the log when it is lost)
    waiters: list[asyncio.Future]       # askers waiting for its answer


class FleetReporter:
    def __init__(self, send: Callable[[dict], Awaitable[dict]], limiter: RateLimiter, meter: UsageMeter,
                 name: str = "", interval_s: float = 1.0, ask_timeout_s: float = GRANT_TTL_S,
                 clock: Callable[[], float] = time.monotonic,
                 on_revoked: Callable[[list[int]], None] | None = None) -> None:
        self._send = send
        self._on_revoked = on_revoked
        self.limiter = limiter
        self.meter = meter
        self.name = name
        self.router_id = f"{name or 'router'}-{os.urandom(8).hex()}"[-64:]
        self._interval_s = interval_s
        self._ask_timeout_s = ask_timeout_s
        self._clock = clock
        self._backoff = Backoff(initial_s=0.2, max_s=max(2.0, interval_s))
        self._inflight: _Report | None = None
        self._failing = False   # the last attempt got no answer
        self._waiters: list[asyncio.Future] = []   # askers since the last report was taken
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._last_start = -math.inf
        self.num_reports = 0
        self.num_failures = 0
        self.num_refusals = 0   # attempts the registry refused (4xx)
        limiter.on_provisional = self.report_soon

    # -- lifetime ------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="fleet-reports")

    async def stop(self) -> None:
        """Stops the loop, then sends what is left (the report in flight, then one last), briefly."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            async with asyncio.timeout(STOP_FLUSH_TIMEOUT_S):
                while self._inflight is not None:
                    if not await self.report_once():
                        await asyncio.sleep(self._backoff.next_delay())
                await self.report_once()
        except TimeoutError:
            log.warning("stopping without the last fleet report: the registry did not answer in %.0f s",
                        STOP_FLUSH_TIMEOUT_S)

    async def _run(self) -> None:
        while True:
            delay = self._backoff.next_delay() if self._failing else self._interval_s
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except TimeoutError:
                pass
            self._wake.clear()
            gap = self._last_start + MIN_GAP_S - self._clock()
            if gap > 0:
                await asyncio.sleep(gap)
            try:
                await self.report_once()
            except Exception:  # a bug here must not end the reports: the next round tries again
                log.exception("fleet report failed")

    # -- reporting -----------------------------------------------------------------------------

    async def report_once(self) -> bool:
        """Sends the report in flight again, or takes a new one and sends it; True when answered."""
        if self._inflight is None:
            self._inflight = self._take()
        report = self._inflight
        while True:
            self._last_start = sent_at = self._clock()
            try:
                answer = await self._send(report.body)
                break
            except RegistryError as exc:
                if exc.status >= 500:
                    return self._failed(report, exc)
                self.num_refusals += 1
                if not self._narrow(report, exc):
                    return self._drop(report, exc)
            except httpx.HTTPError as exc:
                return self._failed(report, exc)
        self._inflight = None
        self._failing = False
        self._backoff.reset()
        self.num_reports += 1
        self.limiter.answered(report.seq, sent_at, answer)
        if answer.get("revoked_keys") and self._on_revoked is not None:
            self._on_revoked(answer["revoked_keys"])
        for waiter in report.waiters:
            if not waiter.done():
                waiter.set_result(True)
        return True

    def _take(self) -> _Report:
        part = self.limiter.take_report()
        usage = self.meter.take(MAX_REPORT_USAGE)
        body = {"router_id": self.router_id, "name": self.name, "seq": part.seq,
                "charges": [{"key_id": c.key_id, "slot": c.slot, "requests": c.requests, "tokens": c.tokens}
                            for c in part.charges],
                "usage": [{"key_id": u.key_id, "model": u.model, "hour": u.hour,
                           **{name: getattr(u, name) for name in USAGE_COUNTS}} for u in usage],
                "demand": [{"key_id": d.key_id, "requests": d.requests, "tokens": d.tokens,
                            "remaining_requests": d.remaining_requests, "remaining_tokens": d.remaining_tokens}
                           for d in part.demand]}
        waiters, self._waiters = self._waiters, []
        return _Report(part.seq, body, sum(u.requests for u in usage), waiters)

    def _narrow(self, report: _Report, refusal: RegistryError) -> bool:
        """Leaves out of the refused report its next part that may be at fault; False when nothing is
        left to leave out (or the refusal is not of its content)."""
        if refusal.status not in CONTENT_REFUSALS:
            return False
        for part, rows in NARROWED_PARTS.items():
            if report.body[part]:
                served = f" ({report.num_requests} served request(s))" if part == "usage" else ""
                log.error("the registry refused fleet report %d (%s); sending it again without its %d %s%s, "
                          "which are dropped", report.seq, refusal, len(report.body[part]), rows, served)
                report.body = {**report.body, part: []}
                return True
        return False

    def _drop(self, report: _Report, refusal: RegistryError) -> bool:
        log.error("the registry refused fleet report %d (%s); dropping it with %d rate-limit charge(s), %d served "
                  "request(s) and the demand of %d key(s) in it", report.seq, refusal, len(report.body["charges"]),
                  report.num_requests if report.body["usage"] else 0, len(report.body["demand"]))
        self._inflight = None
        for waiter in report.waiters:   # no grant comes: their requests are refused now, not at their deadline
            if not waiter.done():
                waiter.set_result(False)
        return False

    def _failed(self, report: _Report, exc: Exception) -> bool:
        self.num_failures += 1
        self.limiter.failed()
        if not self._failing:
            log.warning("fleet report %d got no answer (%s); sending it again with backoff", report.seq, exc)
        self._failing = True
        return False

    async def admit(self, key_id, requests_per_minute: int | None, tokens_per_minute: int | None,
                    num_tokens: int) -> Charge | Refusal | None:
        """The limiter's decision, after early reports for as long as it says one may bring room (up to
        `ask_timeout_s` in all); None for a key without limits (or without a registry id: nothing to
        charge or meter)."""
        if not isinstance(key_id, int):
            return None
        decision = self.limiter.admit(key_id, requests_per_minute, tokens_per_minute, num_tokens)
        deadline = self._clock() + self._ask_timeout_s
        while isinstance(decision, Refusal) and decision.ask:
            if not await self.ask(deadline - self._clock()):
                break
            decision = self.limiter.admit(key_id, requests_per_minute, tokens_per_minute, num_tokens, retry=True)
        return decision

    async def ask(self, timeout_s: float | None = None) -> bool:
        """Has a report go out now (after the one in flight, if any) and waits for its answer, up to
        `timeout_s` (`ask_timeout_s` when None); False when none came in time."""
        timeout_s = self._ask_timeout_s if timeout_s is None else timeout_s
        if timeout_s <= 0:
            return False
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._wake.set()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            return False
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def report_soon(self) -> None:
        """Has the next report go out now (after the one in flight, if any) rather than at the interval;
        nobody waits for it."""
        if not self._failing:
            self._wake.set()

    def status(self) -> dict:
        return {**self.limiter.status(), "router_id": self.router_id, "num_reports": self.num_reports,
                "num_report_failures": self.num_failures, "num_report_refusals": self.num_refusals,
                "reports_failing": self._failing}
