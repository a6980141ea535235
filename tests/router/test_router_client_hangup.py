"""A client that hangs up before its answer is complete ends the work done for it: the site's call is
cancelled whether the client streamed or not, and whether it left during the first-token wait (a long
prefill, a KV handoff between a prefill and a decode site) or while the answer was generated."""

from __future__ import annotations

import asyncio
import json

from router_fake_agent import MODEL

LONG_WAIT = {"first_token_timeout_s": 60.0, "token_idle_timeout_s": 60.0}  # far past the polls below


async def _send_and_hang_up(url: str, key: str, body: dict, until, path: str = "/v1/chat/completions") -> None:
    """POSTs `body`, waits until `until()` holds (the site is working on it), then closes the connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    _reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()
    await _eventually(until)
    writer.close()
    await writer.wait_closed()


async def _eventually(condition, within_s: float = 5.0) -> None:
    for _ in range(int(within_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    assert condition()


def _called(agent, method: str) -> bool:
    return any(name == method for name, _ in agent.calls)


def _chat(max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "stream": stream}


async def test_non_streaming_client_that_hangs_up_stops_the_generation(cluster, make_router):
    agent = await cluster.add_site("fra", 50.1, 8.7)
    agent.token_delay_s = 0.05  # 1000 tokens: 50 s of work for no one, were it not cancelled
    key = await cluster.create_key()
    router, url = await make_router(**LONG_WAIT)
    await _send_and_hang_up(url, key, _chat(1000, stream=False), lambda: _called(agent, "Generate"))
    await _eventually(lambda: agent.num_cancelled == 1)
    await _eventually(lambda: router.metrics.requests_running._value.get() == 0)


async def test_client_that_hangs_up_before_the_first_token_stops_the_generation(cluster, make_router):
    agent = await cluster.add_site("fra", 50.1, 8.7)
    agent.stall_after = 0  # a long prefill: no first token for as long as the client would wait
    key = await cluster.create_key()
    router, url = await make_router(**LONG_WAIT)
    await _send_and_hang_up(url, key, _chat(50, stream=True), lambda: _called(agent, "Generate"))
    await _eventually(lambda: agent.num_cancelled == 1)
    await _eventually(lambda: router.metrics.requests_running._value.get() == 0)
    assert [method for method, _ in agent.calls].count("Generate") == 1  # not tried again for no one


async def test_client_that_hangs_up_during_the_kv_handoff_stops_the_decode_and_ends_the_lease(cluster, make_router):
    prefill = await cluster.add_site("fra-p", 50.1, 8.7, role="prefill")
    decode = await cluster.add_site("fra-d", 50.1, 8.7, role="decode")
    decode.stall_after = 0  # the prefill's token is sent; the decode site's first token never comes
    key = await cluster.create_key()
    _router, url = await make_router(**LONG_WAIT)
    await _send_and_hang_up(url, key, _chat(50, stream=False), lambda: _called(decode, "Decode"))
    await _eventually(lambda: decode.num_cancelled == 1)
    handle = decode.calls[-1][1].kv_source.kv_handle
    await _eventually(lambda: handle in prefill.released)  # the decode site never took it: ended, not left to expire


async def test_client_that_hangs_up_after_one_prompts_prefill_ends_that_prompts_lease(cluster, make_router):
    """Two prompts in one request: the first is prefilled (its KV leased for a decode site), the second's
    prefill takes long; the client leaving then must end the first prompt's lease, not leave it held
    on the prefill site until it expires."""
    prefill = await cluster.add_site("fra-p", 50.1, 8.7, role="prefill")
    await cluster.add_site("fra-d", 50.1, 8.7, role="decode")
    prefill.hang_if = lambda method, request: method == "Prefill" and len(request.prompt_ids) > 10
    key = await cluster.create_key()
    _router, url = await make_router(**LONG_WAIT)
    body = {"model": MODEL, "prompt": ["hi", "a much longer prompt that takes its time " * 4], "max_tokens": 20}
    await _send_and_hang_up(url, key, body, lambda: [m for m, _ in prefill.calls].count("Prefill") == 2,
                            path="/v1/completions")
    await _eventually(lambda: len(prefill.released) == 1)
    hung = next(request for method, request in prefill.calls if method == "Prefill" and len(request.prompt_ids) > 10)
    await _eventually(lambda: hung.lease_id in prefill.released_lease_ids)  # whatever it leased ends too
