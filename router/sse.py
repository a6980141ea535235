"""A lean ASGI response for server-sent events, and `ClientWatch`: work that stops when its client leaves.

Each step's events go out in one write and the last batch carries the end of the body, because on
a busy router the write per event, not the JSON, is what costs. A client that disconnects cancels
the stream (and with it the agent call) instead of letting the site generate for no one; the same
holds before the first byte, while a request waits for its first token or its whole answer. One
`ClientWatch` (one task) watches a request from its first token wait to its stream's end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import ClientDisconnect
from starlette.responses import Response


class ClientWatch:
    """One task that reads the client's side of the connection for the whole request, and cancels the
    work `async with watch.guarding():` encloses as soon as the client disconnects; that block then leaves
    with ClientDisconnect instead of CancelledError. Start it once the request body has been read: it
    consumes the request's remaining ASGI messages. `close()` ends the reading.

    A streamed answer is guarded twice, while it waits for its first token and then while it streams
    (`SSEResponse`), by the same watch: between the two, a disconnect is only noted, and the second
    guard leaves with ClientDisconnect at once.

    The task is cancelled at the await it is suspended on, so the work below it (an agent call, a wait
    for room on a full site) ends there, and its own `finally` blocks end the agent calls and give back
    what it held.
    """

    def __init__(self, receive) -> None:
        self._receive = receive
        self.disconnected = False
        self._guarded: asyncio.Task | None = None
        self._reader = asyncio.ensure_future(self._read())

    def guarding(self) -> _Guard:
        return _Guard(self)

    def close(self) -> None:
        self._reader.cancel()

    async def _read(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        if self._guarded is not None:
            self._guarded.cancel()


class _Guard:
    """One block of work that ends when the watch's client disconnects (ClientWatch.guarding)."""

    def __init__(self, watch: ClientWatch) -> None:
        self._watch = watch
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> ClientWatch:
        if self._watch.disconnected:
            raise ClientDisconnect()
        self._task = self._watch._guarded = asyncio.current_task()
        return self._watch

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        # No await in here: the reader cannot run between the block's end and this check.
        self._watch._guarded = None
        if not self._watch.disconnected:
            return False
        if self._task.cancelling():
            self._task.uncancel()
        if exc_type is None or not issubclass(exc_type, asyncio.CancelledError):
            # The block ended on its own (a cancellation something below swallowed): its result or
            # failure stands, so what it holds is still closed by whoever receives it.
            return False
        raise ClientDisconnect()


class SSEResponse(Response):
    # A Response subclass only so FastAPI passes it through untouched; __call__ is all its own.
    def __init__(self, batches: AsyncIterator[tuple[bytes, bool]], headers: dict[str, str],
                 watch: ClientWatch) -> None:
        """batches: (events, is_last); the last one ends the body. watch: the request's, which this
        response guards the stream with and closes."""
        self._batches = batches
        self._watch = watch
        self.status_code = 200
        self.background = None
        self._headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        self._headers += [(k.lower().encode(), v.encode()) for k, v in headers.items()]

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self._headers})
            async with self._watch.guarding():
                last = False
                async for batch, last in self._batches:
                    await send({"type": "http.response.body", "body": batch, "more_body": not last})
                    if last:
                        break
                if not last:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ClientDisconnect:
            pass  # no one to send the rest to; the generation ended with the batches
        finally:
            self._watch.close()
            await self._batches.aclose()
