"""Raw-socket checks of the request-head limits (registry.http_head) shared by the registry's and
the router's tests: the services are reached on loopback exactly as a client would."""

from __future__ import annotations

import asyncio

HEAD = b"GET /healthz HTTP/1.1\r\nHost: edgefire\r\n"


async def exchange(port: int, chunks, pause_s: float = 0.0, timeout_s: float = 10.0) -> bytes:
    """Sends chunks (stopping once the server has answered or hung up) and returns its answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = asyncio.ensure_future(reader.read(65536))
    try:
        for chunk in chunks:
            if answer.done():
                break
            try:
                writer.write(chunk)
                await writer.drain()
            except ConnectionError:
                break
            if pause_s:
                await asyncio.sleep(pause_s)
        return await asyncio.wait_for(answer, timeout_s)
    finally:
        answer.cancel()
        writer.close()


def huge_header(num_bytes: int = 32 * 1024 * 1024, chunk: int = 256 * 1024):
    yield HEAD + b"X-Big: "
    for _ in range(num_bytes // chunk):
        yield b"a" * chunk


def many_headers(count: int = 1000):
    yield HEAD + b"".join(b"X-H%d: v\r\n" % i for i in range(count)) + b"\r\n"


async def assert_head_limits(port: int) -> None:
    """A 32 MiB header and 1,000 headers are refused with 431, a head that stalls with 408 (the
    caller shortens HeadLimitedHttp.head_timeout_s), and the service still answers afterwards."""
    assert (await exchange(port, huge_header())).startswith(b"HTTP/1.1 431 ")
    assert (await exchange(port, many_headers())).startswith(b"HTTP/1.1 431 ")
    stalled = await exchange(port, [HEAD[:20]], timeout_s=5.0)
    assert stalled.startswith(b"HTTP/1.1 408 "), stalled
    assert (await exchange(port, [HEAD + b"\r\n"])).startswith(b"HTTP/1.1 200 ")


async def assert_body_deadline(port: int, path: str, authorization: bytes | None = None) -> None:
    """A body shorter than its Content-Length, and one trickled a byte at a time, are refused with 408
    once the caller's shortened HeadLimitedHttp.body_timeout_s (0.5 s) has passed (both held their
    connection for ever), a body sent in time is answered, and the service still answers afterwards.
    `authorization`: the header's value, where the service checks it before reading a body."""
    auth = b"Authorization: %s\r\n" % authorization if authorization else b""
    head = (b"POST %s HTTP/1.1\r\nHost: edgefire\r\nContent-Type: application/json\r\n%sContent-Length: 100\r\n\r\n"
            % (path, auth))
    short = await exchange(port, [head + b'{"model":'], timeout_s=5.0)
    assert short.startswith(b"HTTP/1.1 408 ") and b"request body not complete within 0.5 s" in short, short
    trickled = await exchange(port, [head] + [b" "] * 99, pause_s=0.1, timeout_s=5.0)
    assert trickled.startswith(b"HTTP/1.1 408 "), trickled
    in_time = await exchange(port, [head, b" " * 50, b" " * 50], pause_s=0.1)
    assert not in_time.startswith(b"HTTP/1.1 408 "), in_time  # the service's own answer to the (empty) body
    assert (await exchange(port, [HEAD + b"\r\n"])).startswith(b"HTTP/1.1 200 ")
