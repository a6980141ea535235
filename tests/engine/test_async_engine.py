"""The asyncio front: streaming, cancellation, and transfer between two engines."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.async_engine import AsyncEngine
from engine.engine import EngineConfig, LLMEngine
from engine.errors import UnknownHandleError
from engine.kv_transfer import KVPayload
from engine.sampling import SamplingParams


@pytest.fixture
def engines(llama_checkpoint):
    made = [AsyncEngine(LLMEngine(llama_checkpoint[0], EngineConfig(kv_cache_bytes=8 << 20, show_progress=False)))
            for _ in range(2)]
    yield made
    for engine in made:
        engine.shutdown()


async def test_concurrent_streams_and_transfer(engines):
    a, b = engines
    params = SamplingParams(max_tokens=8, temperature=0.6, seed=5, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (7, 30, 55)]

    async def collect(p):
        return [e.token_id async for e in a.generate(p, params)]

    colocated = await asyncio.gather(*(collect(p) for p in prompts))
    for p, expected in zip(prompts, colocated):
        first = await a.prefill(p, params)
        payload = await a.export_kv(first.kv_handle)
        await a.release_kv(first.kv_handle)
        rest = [e.token_id async for e in b.generate_from_kv(payload, params, [first.token_id])]
        assert [first.token_id] + rest == expected
    for engine in engines:
        stats = await engine.stats()
        assert stats.num_blocks_free == stats.num_blocks_total


async def test_leaving_a_stream_aborts_and_frees(engines):
    a, _ = engines
    stream = a.generate(list(range(1, 40)), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    async for _ in stream:
        break
    await stream.aclose()
    stats = await a.stats()
    assert stats.num_running == 0 and stats.num_blocks_free == stats.num_blocks_total


async def test_a_request_cancelled_before_the_engine_takes_it_is_aborted(engines):
    """A caller cancelled while its request waits behind a step (a client gone, a timeout) leaves nothing
    running: the engine thread still adds the request, and an abort queued behind it ends it."""
    a, _ = engines
    busy = threading.Event()
    held = asyncio.ensure_future(a.call(lambda engine: busy.wait(5)))   # the engine thread, mid-step

    async def consume():
        async for _ in a.generate(list(range(1, 40)), SamplingParams(max_tokens=200, ignore_eos=True)):
            pass
    cancelled = [asyncio.ensure_future(consume()) for _ in range(3)]
    await asyncio.sleep(0.05)   # each has handed its request to the engine thread
    for task in cancelled:
        task.cancel()
    await asyncio.gather(*cancelled, return_exceptions=True)
    busy.set()
    await held
    stats = await a.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_blocks_free == stats.num_blocks_total


async def test_errors_reach_the_caller(engines):
    from engine.errors import InvalidRequestError
    a, _ = engines
    with pytest.raises(InvalidRequestError, match="empty"):
        async for _ in a.generate([], SamplingParams()):
            pass


async def test_a_kv_pull_starts_while_the_engine_is_in_a_long_step(engines):
    """The decode site reads a lease at once, even while the prefill site's engine is busy (a long
    prefill chunk): opening an export does not wait for the engine thread. The lease still ends
    only on the engine thread, and the blocks come back once it does."""
    a, b = engines
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = list(range(5, 60))
    expected = [e.token_id async for e in a.generate(prompt, params)]
    first = await a.prefill(prompt, params)
    release = threading.Event()
    busy = asyncio.ensure_future(a.call(lambda _engine: release.wait(30)))  # a step that does not end
    try:
        export = await asyncio.wait_for(a.open_export(first.kv_handle), timeout=5)
        chunks = await asyncio.to_thread(lambda: list(export.chunks()))
        assert not busy.done()
    finally:
        release.set()
        await busy
    a.close_export(export)
    await a.release_kv(first.kv_handle)
    payload = KVPayload(export.layout, export.token_ids, chunks)
    assert [first.token_id] + [e.token_id async for e in b.generate_from_kv(payload, params, [first.token_id])] \
        == expected
    stats = await a.stats()
    assert stats.num_pinned_handles == 0 and stats.num_blocks_free == stats.num_blocks_total


async def test_a_lease_whose_release_is_queued_opens_no_second_export(engines):
    """A pull ends its single-use lease before its last chunk goes out, but the release waits for the
    engine thread: a second pull in that moment must be refused, not served the same blocks again."""
    a, _ = engines
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = await a.prefill(list(range(7, 50)), params)
    release = threading.Event()
    busy = asyncio.ensure_future(a.call(lambda _engine: release.wait(30)))  # the engine thread is in a step
    try:
        export = await a.open_export(first.kv_handle)
        a.close_export(export)
        a.release_kv_nowait(first.kv_handle)  # queued behind the step
        with pytest.raises(UnknownHandleError):
            await a.open_export(first.kv_handle)
        assert not busy.done() and first.kv_handle in a.engine.leases  # its blocks are still held
    finally:
        release.set()
        await busy
    stats = await a.stats()
    assert stats.num_pinned_handles == 0 and stats.num_blocks_free == stats.num_blocks_total


async def test_calls_queued_when_the_engine_crashes_or_stops_fail_instead_of_waiting_forever(llama_checkpoint):
    """A heartbeat's stats, a metrics scrape or an abort queued behind the step that crashed the engine
    thread (or behind its shutdown) must fail with EngineDeadError: the agent waits on them as it stops."""
    from engine.async_engine import EngineDeadError

    engine = AsyncEngine(LLMEngine(llama_checkpoint[0], EngineConfig(kv_cache_bytes=8 << 20, show_progress=False)))
    stepping, crash = threading.Event(), threading.Event()
    real_step = engine.engine.step

    def failing_step():
        stepping.set()
        crash.wait(10)  # a stats call is queued meanwhile
        raise RuntimeError("device lost")

    engine.engine.step = failing_step
    stream = engine.generate([3, 4, 5], SamplingParams(max_tokens=4))
    reading = asyncio.ensure_future(stream.__anext__())
    await asyncio.to_thread(stepping.wait, 10)
    queued = asyncio.ensure_future(engine.stats())
    await asyncio.sleep(0.05)
    crash.set()
    with pytest.raises(EngineDeadError, match="device lost"):
        await asyncio.wait_for(queued, 10)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(reading, 10)
    with pytest.raises(EngineDeadError):  # and a call made after the crash is refused at once
        await engine.stats()
    engine.engine.step = real_step
    engine.shutdown()
