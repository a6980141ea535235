"""Reports what this router placed to the registry every `interval_s`, for the dashboard's arcs.

    reporter = PlacementReporter(registry.report_placements, metrics, interval_s=5.0)
    reporter.start() ... await reporter.stop()      # stop sends what is left

The counts come from `RouterMetrics.unreported` (one dict increment per placed request); a report
takes them all. When the registry cannot take a report the counts go back and ride with the next
one (at most MAX_PAIRS pairs are kept), and the failure is counted as a registry error; it is only
logged once per streak, since the dashboard is the only thing that misses them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httpx

from registry.client import RegistryError
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)

MAX_PAIRS = 10_000


class PlacementReporter:
    def __init__(self, report: Callable[[list[dict]], Awaitable], metrics: RouterMetrics, interval_s: float) -> None:
        self._report = metrics.counting_errors("placements", report)
        self._metrics = metrics
        self._interval_s = interval_s
        self._task: asyncio.Task | None = None
        self._failing = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="placement-report")

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        await self.report_now()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.report_now()

    async def report_now(self) -> None:
        """Sends every count not reported yet; never raises."""
        pairs, self._metrics.unreported = self._metrics.unreported, {}
        if not pairs:
            return
        body = [{"prefill_site": p, "decode_site": d, "num_requests": n} for (p, d), n in pairs.items()]
        try:
            await self._report(body)
        except (httpx.HTTPError, RegistryError) as exc:
            self._keep(pairs)
            if not self._failing:
                log.warning("placement report to the registry failed (%s); keeping the counts for the next one", exc)
            self._failing = True
            return
        if self._failing:
            log.info("placement reports reach the registry again")
        self._failing = False

    def _keep(self, pairs: dict[tuple[str, str], int]) -> None:
        unreported = self._metrics.unreported
        for pair, count in pairs.items():
            if pair in unreported or len(unreported) < MAX_PAIRS:
                unreported[pair] = unreported.get(pair, 0) + count
