"""`POST /v1/agent/heartbeat` as a raw ASGI endpoint in front of FastAPI.

Heartbeats are nearly all of the registry's requests (every site, every interval), and FastAPI's
per-request machinery (telemetry check, middleware stack, routing, Request objects) costs more CPU
than storing one. `serve` answers them before FastAPI sees them, with the same checks in the same
order (body size, token, body) and the same bodies, because the work and the error mapping are the
ones the FastAPI route uses (`routes_agent.store_heartbeat`, `http_errors.response_for`).
FastAPI's native telemetry therefore does not trace heartbeats.
"""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import PlainTextResponse

from registry import http_errors
from registry.app_state import RegistryService
from registry.auth import authorization_header
from registry.body_limit import read_messages, refuse
from registry.routes_agent import store_heartbeat

PATH = "/v1/agent/heartbeat"

log = logging.getLogger(__name__)


def is_heartbeat(scope) -> bool:
    return scope["type"] == "http" and scope["path"] == PATH and scope["method"] == "POST"


async def serve(service: RegistryService, max_bytes: int, scope, receive, send) -> None:
    """Answers one heartbeat; `scope["app"]` must be the registry app (the error handlers count there)."""
    messages = await read_messages(scope, receive, max_bytes)
    if messages is None:
        await refuse(send, max_bytes)
        return
    if messages[-1]["type"] != "http.request":
        return  # the client went away before sending its whole body
    body = b"".join([message.get("body", b"") for message in messages])
    try:
        reply = await store_heartbeat(service, authorization_header(scope["headers"]), body)
    except Exception as exc:
        await _error(scope, receive, send, exc)
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(reply)).encode()), (b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": reply})


async def _error(scope, receive, send, exc: Exception) -> None:
    """The response FastAPI's handlers give; for an unmapped exception, Starlette's plain 500."""
    try:
        response = await http_errors.response_for(Request(scope), exc)
    except Exception:
        log.exception("heartbeat failed")
        response = PlainTextResponse("Internal Server Error", status_code=500)
    await response(scope, receive, send)
