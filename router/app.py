"""The HTTP edge: FastAPI routes that read, authenticate and translate, then call CompletionService.

Errors become OpenAI bodies here and only here (`ApiError` → JSON with its status and headers).
A stream that breaks for good after its first byte ends with one SSE error event and no [DONE].
Logs carry request ids, sites and counts — never API keys or prompt text.
"""

from __future__ import annotations

import json
import logging
import uuid
from contextlib import aclosing
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.completions import CompletionRun, RequestContext
from router.errors import ApiError, error_body, internal_error, too_large
from router.generation import AgentRejected, GenerationFailed
from router.openai_request import parse_json, parse_request
from router.sse import SSEResponse

if TYPE_CHECKING:
    from router.server import Router

log = logging.getLogger(__name__)
SESSION_HEADER = "x-session-affinity"
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def create_app(router: Router) -> FastAPI:
    app = FastAPI(title="edgefire router", version="1", docs_url=None, redoc_url=None,
                  description="OpenAI-compatible endpoint over edgefire sites.")
    app.state.router = router

    async def chat_completions(request: Request) -> Response:
        return await _complete(router, request, chat=True)

    async def completions(request: Request) -> Response:
        return await _complete(router, request, chat=False)

    async def models(request: Request) -> Response:
        await router.authenticate(request.headers.get("authorization"))
        snapshot = router.feed.current()
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "edgefire"} for m in snapshot.models()]
        return JSONResponse({"object": "list", "data": data})

    async def healthz(_request: Request) -> Response:
        return JSONResponse({"ok": True, "snapshot_age_s": round(router.feed.age_s(), 3)})

    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/healthz", healthz, methods=["GET"], include_in_schema=False)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    return app


async def _complete(router: Router, http_request: Request, chat: bool) -> Response:
    request_id = "req-" + uuid.uuid4().hex[:24]
    http_request.state.request_id = request_id
    body = await _read_body(http_request, router.config.max_body_bytes)
    api_key = await router.authenticate(http_request.headers.get("authorization"))
    request = parse_request(parse_json(body), chat)
    client = http_request.client
    location = router.locator.locate(client.host if client else None, http_request.headers)
    ctx = RequestContext(request_id, api_key, location, http_request.headers.get(SESSION_HEADER))
    run = await router.service.start(request, ctx)
    log.debug("request %s: model %s prefill %s decode %s attempts %d", request_id, request.model,
              run.generation.prefill_site, run.generation.decode_site, run.generation.num_attempts)
    if request.stream:
        return SSEResponse(_sse(run), run.headers())
    body = await run.response()
    return Response(_dumps(body).encode(), media_type="application/json", headers=run.headers())


async def _sse(run: CompletionRun):
    """(bytes, is_last) per step for SSEResponse; [DONE] rides in the same write as the finish."""
    try:
        async with aclosing(run.chunks()) as batches:
            async for chunks in batches:
                data = b"".join(b"data: " + _dumps(chunk).encode() + b"\n\n" for chunk in chunks)
                if run.finish_reason is not None:
                    yield data + b"data: [DONE]\n\n", True
                    return
                yield data, False
    except (GenerationFailed, AgentRejected) as exc:
        log.error("request %s: stream failed after %d token(s): %s", run.ctx.request_id,
                  run.num_completion_tokens, exc)
        error = error_body(f"The stream broke and could not be resumed ({exc}); the text so far is incomplete.",
                           "server_error", None, "stream_interrupted")
        yield b"data: " + _dumps(error).encode() + b"\n\n", True


async def _read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(f"The request body exceeds {max_bytes} bytes; send a smaller request.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(f"The request body exceeds {max_bytes} bytes; send a smaller request.")
        chunks.append(chunk)
    return b"".join(chunks)


async def _api_error(_request: Request, exc: ApiError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


async def _http_error(_request: Request, exc: StarletteHTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return JSONResponse(error_body(str(exc.detail), "invalid_request_error", None, code),
                        status_code=exc.status_code)


async def _unexpected(request: Request, exc: Exception) -> Response:
    request_id = getattr(request.state, "request_id", "-")
    log.exception("request %s: unexpected failure", request_id, exc_info=exc)
    error = internal_error(request_id)
    return JSONResponse(error.body(), status_code=error.status)
