"""A lean ASGI response for server-sent events, and `ClientWatch`: work that stops when its client leaves.

Each step's events go out in one write and the last batch carries the end of the body, because on
a busy router the write per event, not the JSON, is what costs. A client that disconnects cancels
the stream (and with it the agent call) instead of letting the site generate for no one; the same
holds before the first byte, while a request waits for its first token or its whole answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import ClientDisconnect
from starlette.responses import Response


class ClientWatch:
    """`async with ClientWatch(receive):` the block is cancelled as soon as the client disconnects, and
    leaves with ClientDisconnect instead of CancelledError. Use it once the request body has been read:
    the watch consumes the request's remaining ASGI messages.

    The task is cancelled at the await it is suspended on, so the work below it (an agent call, a wait
    for room on a full site) ends there, and its own `finally` blocks end the agent calls and give back
    what it held.
    """

    def __init__(self, receive) -> None:
        self._receive = receive
        self.disconnected = False
        self._task: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None

    async def __aenter__(self) -> ClientWatch:
        self._task = asyncio.current_task()
        self._watcher = asyncio.ensure_future(self._watch())
        return self

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        # No await in here: the watcher cannot run between the block's end and this check.
        self._watcher.cancel()
        if not self.disconnected:
            return False
        if self._task.cancelling():
            self._task.uncancel()
        if exc_type is None or not issubclass(exc_type, asyncio.CancelledError):
            # The block ended on its own (a cancellation something below swallowed): its result or
            # failure stands, so what it holds is still closed by whoever receives it.
            return False
        raise ClientDisconnect()

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        self._task.cancel()


class SSEResponse(Response):
    # A Response subclass only so FastAPI passes it through untouched; __call__ is all its own.
    def __init__(self, batches: AsyncIterator[tuple[bytes, bool]], headers: dict[str, str]) -> None:
        """batches: (events, is_last); the last one ends the body."""
        self._batches = batches
        self.status_code = 200
        self.background = None
        self._headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        self._headers += [(k.lower().encode(), v.encode()) for k, v in headers.items()]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self._headers})
        try:
            async with ClientWatch(receive):
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
            await self._batches.aclose()
