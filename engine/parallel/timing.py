"""Where a rank's step time goes: time inside torch.distributed calls vs the rest, per process.

Measured only when EDGEFIRE_PARALLEL_TIMING=1 (benchmarks/parallel.py sets it; the workers inherit
it): otherwise `comm()` hands back one shared no-op context and nothing is timed. A step's time is
rank 0's submit-to-collect, or a worker's from taking a step to passing it on (not the idle wait
for the next one). Communication includes waiting for a peer that is still computing (a TP rank
behind the others, a later pipeline stage), as any measurement inside a collective does.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass

ENABLED = os.environ.get("EDGEFIRE_PARALLEL_TIMING") == "1"


@dataclass(slots=True)
class RankTimes:
    steps: int = 0
    step_s: float = 0.0
    comm_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


TIMES = RankTimes()
_NOTHING = contextlib.nullcontext()


class _Clock:
    __slots__ = ("start", "field")

    def __init__(self, field: str):
        self.field = field

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *_exc):
        setattr(TIMES, self.field, getattr(TIMES, self.field) + time.perf_counter() - self.start)


def comm():
    return _Clock("comm_s") if ENABLED else _NOTHING


def step(count: bool = True):
    """Time spent on a step (count: this is the step's first part, so it counts one step)."""
    if not ENABLED:
        return _NOTHING
    TIMES.steps += count
    return _Clock("step_s")
