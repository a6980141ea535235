"""Group commit for heartbeats: every heartbeat that arrives while one commit runs goes into the
next, so the database sees one multi-row upsert per commit rather than one transaction per site.

Each caller still waits for its own commit, so a 200 means the heartbeat is stored. Rows are
validated before they are queued (registry.wire); should the database still refuse a batch for a
reason other than being unreachable, its rows are stored one by one, so only the row at fault fails.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from registry.errors import InvalidInput
from registry.records import SiteStatus

log = logging.getLogger(__name__)

MAX_BATCH = 2000
# A commit costs ~1-2 ms of CPU however few rows it stores; under load, spacing commits at least this
# far apart lets each store more rows (at most this much added latency), which is what keeps one
# process's CPU for thousands of heartbeats a second. An idle batcher still commits at once.
MIN_COMMIT_INTERVAL_S = 0.005


class HeartbeatBatcher:
    def __init__(self, write_rows: Callable[[list[dict]], dict[int, SiteStatus]], max_batch: int = MAX_BATCH,
                 min_commit_interval_s: float = MIN_COMMIT_INTERVAL_S,
                 on_commit: Callable[[int], None] | None = None) -> None:
        self._write_rows = write_rows
        self._on_commit = on_commit  # told the number of rows of each successful commit (metrics)
        self._max_batch = max_batch
        self._min_commit_interval_s = min_commit_interval_s
        self._pending: list[tuple[dict, asyncio.Future]] = []
        self._wakeup = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task | None = None
        self.num_commits = 0
        self.num_heartbeats = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="heartbeat-batcher")

    async def stop(self) -> None:
        """Commits what is queued, then ends the loop."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await self._task

    async def submit(self, row: dict) -> SiteStatus | None:
        """Stores one checked capacity row; None when the site no longer exists."""
        if self._closing or self._task is None:
            raise RuntimeError("the heartbeat batcher is not running")
        future = asyncio.get_running_loop().create_future()
        self._pending.append((row, future))
        self._wakeup.set()
        return await future

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            loop = asyncio.get_running_loop()
            while self._pending:
                batch, self._pending = self._pending[: self._max_batch], self._pending[self._max_batch :]
                started = loop.time()
                await self._commit(batch)
                rest = self._min_commit_interval_s - (loop.time() - started)
                if rest > 0 and not self._closing:
                    await asyncio.sleep(rest)
            if self._closing:
                return

    async def _commit(self, batch: list[tuple[dict, asyncio.Future]]) -> None:
        rows = [row for row, _ in batch]
        try:
            statuses = await asyncio.to_thread(self._write_with_retry, rows)
        except OperationalError as exc:  # the database is unreachable: every waiter gets the error
            log.error("heartbeat commit of %d rows failed: %s", len(rows), _reason(exc))
            for _, future in batch:
                _settle(future, exception=exc)
            return
        except Exception as exc:  # noqa: BLE001 - a row the database refuses must not fail its batch-mates
            log.warning("heartbeat commit of %d rows failed (%s); storing them one at a time", len(rows), _reason(exc))
            results = await asyncio.to_thread(self._write_one_by_one, rows)
            for (_, future), result in zip(batch, results):
                _settle(future, **result)
            return
        self.num_commits += 1
        self.num_heartbeats += len(rows)
        if self._on_commit is not None:
            self._on_commit(len(rows))
        for row, future in batch:
            _settle(future, result=statuses.get(row["site_id"]))

    def _write_one_by_one(self, rows: list[dict]) -> list[dict]:
        results = []
        for row in rows:
            try:
                statuses = self._write_with_retry([row])
            except OperationalError as exc:
                results.append({"exception": exc})
            except Exception as exc:  # noqa: BLE001 - this row's own failure, answered to its sender
                results.append({"exception": InvalidInput(f"the registry cannot store this heartbeat: {_reason(exc)}",
                                                          "unstorable_heartbeat")})
            else:
                self.num_commits += 1
                self.num_heartbeats += 1
                results.append({"result": statuses.get(row["site_id"])})
        return results

    def _write_with_retry(self, rows: list[dict]) -> dict[int, SiteStatus]:
        try:
            return self._write_rows(rows)
        except IntegrityError:
            # A site was deleted between its existence check and the upsert (PostgreSQL, READ
            # COMMITTED); the retry's check sees the deletion and leaves that row out.
            return self._write_rows(rows)


def _settle(future: asyncio.Future, result=None, exception: BaseException | None = None) -> None:
    if future.done():  # the caller went away
        return
    if exception is not None:
        future.set_exception(exception)
    else:
        future.set_result(result)


def _reason(exc: Exception) -> str:
    """The driver's one-line message, without SQLAlchemy's statement and parameters (which can be huge)."""
    text = str(exc.orig) if isinstance(exc, DBAPIError) else str(exc)
    return text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
