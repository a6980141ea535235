"""ASGI middleware that refuses request bodies over a size limit with a 413, whether the client
declares the size (Content-Length) or streams it (chunked); the app never sees an oversize body.
"""

from __future__ import annotations

import json

from registry.http_errors import error_body

DEFAULT_MAX_BODY_BYTES = 1024 * 1024


class BodySizeLimit:
    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        messages = await read_messages(scope, receive, self.max_bytes)
        if messages is None:
            await refuse(send, self.max_bytes)
            return
        if messages[-1]["type"] != "http.request":
            return  # the client went away (or took too long, registry.http_head) before its body's end
        buffered = iter(messages)

        async def replay():
            for message in buffered:
                return message
            return await receive()

        await self.app(scope, replay, send)


async def read_messages(scope, receive, max_bytes: int) -> list[dict] | None:
    """The request's messages up to the end of its body; None when the body exceeds max_bytes."""
    declared = dict(scope["headers"]).get(b"content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        return None
    messages, total = [], 0
    while True:  # buffered so an oversize stream is refused before the app acts on any of it
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages
        total += len(message.get("body", b""))
        if total > max_bytes:
            return None
        if not message.get("more_body", False):
            return messages


async def refuse(send, max_bytes: int) -> None:
    body = json.dumps(error_body(f"request body exceeds {max_bytes} bytes", "request_too_large",
                                 "body_too_large")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
