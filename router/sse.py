"""A lean ASGI response for server-sent events.

Each step's events go out in one write and the last batch carries the end of the body, because on
a busy router the write per event, not the JSON, is what costs. A client that disconnects cancels
the stream (and with it the agent call) instead of letting the site generate for no one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.responses import Response


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
        streaming = asyncio.current_task()
        disconnected = False

        async def watch() -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            streaming.cancel()

        watcher = asyncio.create_task(watch())
        try:
            last = False
            async for batch, last in self._batches:
                await send({"type": "http.response.body", "body": batch, "more_body": not last})
                if last:
                    break
            if not last:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not disconnected:
                raise
            streaming.uncancel()
        finally:
            watcher.cancel()
            await self._batches.aclose()
