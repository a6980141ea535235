"""The threads the CPU decoders spread a tensor's chunks over.

Both CPU decoders release the GIL while they work (torch ops; the native decoder's C loop), so
plain Python threads decode disjoint chunk ranges on all cores. One pool, sized like torch's
intra-op threads, serves both; a single piece of work stays on the calling thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import torch

_pool: ThreadPoolExecutor | None = None


def num_workers() -> int:
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


def run(work: Callable[..., None], pieces: list[tuple]) -> None:
    """work(*piece) for every piece, on the pool when there are several; the first error is raised."""
    if len(pieces) == 1 or num_workers() == 1:
        for piece in pieces:
            work(*piece)
        return
    futures = [_executor().submit(work, *piece) for piece in pieces]
    wait(futures)   # all pieces end before an error is raised: none still writes the output after
    for future in futures:
        future.result()


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=num_workers(), thread_name_prefix="bf16-decode")
    return _pool
