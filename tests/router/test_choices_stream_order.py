"""A stream of several choices sends every choice's last chunk (its finish reason) before it ends, however far
its choices' runs read ahead of the client: with one message per agent step for all of a router's requests, a
step's tokens for every choice arrive at once, and a run may have made its last chunk before the router sends
an earlier one of it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from router.completions import Choices


class ReadAheadRun:
    """A choice's run that makes `num_batches` batches at once, its finish reason set as it makes the last."""

    def __init__(self, index: int, num_batches: int) -> None:
        self.index = index
        self.num_batches = num_batches
        self.finish_reason = None
        self.request = SimpleNamespace(include_usage=False)
        self.ctx = self.generation = self.metrics = None

    async def chunks(self):
        for i in range(self.num_batches):
            if i == self.num_batches - 1:
                self.finish_reason = "length"
            yield [f"{self.index}:{i}".encode()]


async def test_each_runs_last_batch_goes_out_before_the_stream_ends():
    runs = [ReadAheadRun(index, 4) for index in range(3)]
    sent = []
    async for batch in Choices(runs).chunks():
        sent += batch
        await asyncio.sleep(0)   # the client reads slower than the runs make batches
    assert sorted(sent) == sorted(f"{run.index}:{i}".encode() for run in runs for i in range(4))
