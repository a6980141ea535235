"""The asyncio front's relay of tokens to a stream's reader: what a reader that fell behind is told, and
a reader that leaves while waiting for its next token."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.async_engine import AsyncEngine
from engine.engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams


@pytest.fixture
def engine(llama_checkpoint):
    made = AsyncEngine(LLMEngine(llama_checkpoint[0], EngineConfig(kv_cache_bytes=8 << 20, show_progress=False)))
    yield made
    made.shutdown()


async def until_idle(engine: AsyncEngine) -> None:
    """Until the engine has no work and every token it made was handed to its stream: a call's answer
    reaches the loop after the deliveries of the steps before it."""
    while await engine.call(lambda e: e.has_work()):
        pass


async def test_tokens_that_queued_while_the_reader_was_behind_say_another_is_waiting(engine):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = list(range(3, 20))
    expected = [e.token_id async for e in engine.generate(prompt, params)]
    stream = engine.generate(prompt, params)
    first = await anext(stream)
    await until_idle(engine)  # the reader reads nothing while the engine makes the other five tokens
    rest = [event async for event in stream]
    assert [first.token_id] + [e.token_id for e in rest] == expected
    assert [e.more for e in rest] == [True] * 4 + [False]
    assert rest[-1].finish_reason == "length"


async def test_a_reader_cancelled_while_waiting_for_its_next_token_aborts_its_request(engine):
    """A client that goes away while its stream waits for a step: the request stops and frees its blocks."""
    stream = engine.generate(list(range(1, 40)), SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
    await anext(stream)
    release, inside = threading.Event(), threading.Event()
    busy = asyncio.ensure_future(engine.call(lambda _e: (inside.set(), release.wait(10))))  # no step runs now
    await asyncio.to_thread(inside.wait, 10)
    waited = False
    while not waited:  # read what queued before the engine stopped, then wait for a token that does not come
        try:
            await asyncio.wait_for(anext(stream), 0.5)
        except TimeoutError:
            waited = True
    release.set()
    await busy
    stats = await engine.stats()  # runs after the abort, queued when the read was cancelled
    assert stats.num_running == stats.num_waiting == 0 and stats.num_blocks_free == stats.num_blocks_total
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
