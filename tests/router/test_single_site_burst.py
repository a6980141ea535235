"""A long prompt at the only site while another waits in its engine's queue, both more than its KV pool holds
together: its agent refuses the second (RESOURCE_EXHAUSTED, since it counts the blocks queued requests will
take), and the router waits for room and places it again, so it is served once the first is done, not failed.

A real in-process agent serves the tiny checkpoint behind one router, as in test_router_session.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

import httpx

from node_agent.config import AgentConfig
from node_agent.daemon import Agent

MODEL = "tiny-real"
PEER_TOKEN = "peer-secret"


def body(index: int) -> dict:
    """100 prompt tokens and 4 new ones: 7 blocks of 16, so a pool of 12 runs one at a time."""
    return {"model": MODEL, "prompt": [(index + 13 * i) % 500 + 5 for i in range(100)], "max_tokens": 4,
            "temperature": 0}


@contextmanager
def no_steps(engine):
    """Within: the engine thread adds the requests handed to it, but runs no step (they stay queued)."""
    step, stopped = engine.engine.step, threading.Event()
    engine.engine.step = lambda: [] if not stopped.wait(0.01) else step()
    try:
        yield
    finally:
        stopped.set()
        engine.engine.step = step


async def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_long_prompt_behind_a_queued_one_at_the_only_site_is_waited_for_not_failed(cluster, make_router,
                                                                                          tiny_model_dir):
    agent = Agent(AgentConfig(site="oslo", models={MODEL: str(tiny_model_dir)}, grpc_listen="127.0.0.1:0",
                              metrics_listen=None, peer_token=PEER_TOKEN, kv_cache_bytes=12 * 8192, device="cpu",
                              dtype="float32"))
    await agent.start()
    try:
        await cluster.admin.create_site("oslo", region="eu", country="NO", lat=59.9, lon=10.7,
                                        grpc_address=agent.address, models=[{"model": MODEL, "role": "both"}],
                                        heartbeat_interval_s=60)
        await cluster.heartbeat("oslo")   # an idle site with room to spare: the router's view lets both through
        key = await cluster.create_key()
        _router, url = await make_router(peer_token=PEER_TOKEN, first_token_timeout_s=30, token_idle_timeout_s=30,
                                         allow_split=False)
        engine, refused = agent.models[MODEL].engine, agent.metrics.rejected.labels("kv")
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(timeout=60) as http:
            def send(index: int) -> asyncio.Future:
                return asyncio.ensure_future(http.post(f"{url}/v1/completions", headers=headers, json=body(index)))

            with no_steps(engine):
                first = send(0)
                await wait_until(lambda: engine.latest_stats.num_waiting == 1
                                 and not engine.admission_figures().num_pending)
                second = send(1)
                await wait_until(lambda: refused._value.get() or engine.latest_stats.num_waiting > 1
                                 or engine.admission_figures().num_pending)
                assert refused._value.get() >= 1, "the second was admitted to wait behind the first"
            burst = [await first, await second]
            assert [r.status_code for r in burst] == [200, 200], [r.text for r in burst]
            alone = [await http.post(f"{url}/v1/completions", headers=headers, json=body(i)) for i in range(2)]
        assert [r.json()["choices"][0]["text"] for r in burst] == [r.json()["choices"][0]["text"] for r in alone]
        assert all(r.json()["usage"]["completion_tokens"] == 4 for r in burst)
    finally:
        await agent.stop()
