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
