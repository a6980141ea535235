"""The HTTP edge: routes that read, authenticate and translate, then call CompletionService.

Completions are served as raw ASGI in front of FastAPI (`RouterApp`); the rest, embeddings
(router.embeddings) among them, are FastAPI routes.
FastAPI keeps the completion routes for the OpenAPI spec, whose request bodies `router.openapi` states.

Errors become OpenAI bodies here and only here (`ApiError` → JSON with its status and headers).
A stream that breaks for good after its first byte ends with one SSE error event and no [DONE].
Logs carry request ids, sites and counts — never API keys or prompt text. Each completion joins the
client's W3C trace (`traceparent` header, with its `tracestate`) or starts one; the trace goes to every
site the request reaches and into every log line about it (node_agent.trace), and back in `x-edgefire-trace-id`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from node_agent import trace
from registry.http_head import RepeatedHeader, single_header
from router.api_keys import authorization_header
from router.completions import Choices, CompletionRun, RequestContext
from router.embeddings import EMBEDDINGS_PATH, EmbeddingService, parse_embedding_request
from router.errors import ApiError, error_body, internal_error, not_in_regions, too_large, unknown_model
from router.generation import AgentRejected, GenerationFailed
from router.openai_request import parse_json, parse_request
from router.openapi import describe_completions
from router.placement import model_availability, servable_models
from router.responses import encode_json
from router.responses_api import RESPONSES_PATH, ResponsesEdge, stored_response_not_found
from router.sessions import session_key
from router.sse import ClientWatch, SSEResponse

if TYPE_CHECKING:
    from router.server import Router

log = logging.getLogger(__name__)
SESSION_HEADER = "x-session-affinity"
COMPLETION_PATHS = {"/v1/chat/completions": True, "/v1/completions": False}  # path -> chat
ENDPOINTS = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, POST /v1/embeddings, "
             "GET /v1/models and GET /v1/models/{model}")


class RouterApp(FastAPI):
    """FastAPI, except that completions are answered before its middleware and routing.

    Completions are nearly all of the router's requests, and FastAPI's per-request machinery
    (middleware stack, routing, Request objects, a wrapper around every send) costs more CPU than
    the router's own work on a short stream. `serve_completion` runs the same handler with the same
    error mapping; everything else (models, health, 404, 405) goes through FastAPI.
    """

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            chat = COMPLETION_PATHS.get(scope["path"])
            if chat is not None:
                await serve_completion(self.state.router, chat, scope, receive, send)
                return
            if scope["path"] == RESPONSES_PATH:
                await serve_responses(self.state.router, scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(router: Router) -> FastAPI:
    app = RouterApp(title="edgefire router", version="1", docs_url=None, redoc_url=None,
                    description="OpenAI-compatible endpoint over edgefire sites.")
    app.state.router = router

    async def chat_completions(request: Request) -> Response:
        return await _complete(router, _new_request_id(request), request.scope, request.receive, chat=True)

    async def completions(request: Request) -> Response:
        return await _complete(router, _new_request_id(request), request.scope, request.receive, chat=False)

    async def responses(request: Request) -> Response:
        return _ResponsesAnswer(router)

    async def embeddings(request: Request) -> Response:
        return await _embed(router, EmbeddingService(router.service), _new_request_id(request), request.scope,
                            request.receive)

    async def stored_response(request: Request, response_id: str) -> Response:
        """Responses are not stored (router.responses_api): none can be read back or deleted."""
        await router.authenticate(authorization_header(request.scope["headers"]))
        raise stored_response_not_found(response_id)

    async def models(request: Request) -> Response:
        api_key = await router.authenticate(authorization_header(request.scope["headers"]))
        snapshot = router.feed.current()
        served = servable_models(snapshot, router.service.cost, api_key.allowed_regions)
        data = await asyncio.gather(*(_model_card(router, m, snapshot) for m in served))
        return JSONResponse({"object": "list", "data": data})

    async def model(request: Request, model: str) -> Response:
        """One model's card (the SDK's `models.retrieve`); 404 for a model /v1/models does not list, 403 for
        one served only outside the key's regions."""
        api_key = await router.authenticate(authorization_header(request.scope["headers"]))
        snapshot = router.feed.current()
        available = model_availability(snapshot, router.service.cost, model, api_key.allowed_regions)
        if available.outside_regions:
            raise not_in_regions(model, api_key.allowed_regions, available.outside_regions)
        if not available.live:
            raise unknown_model(model)
        return JSONResponse(await _model_card(router, model, snapshot))

    async def healthz(_request: Request) -> Response:
        status = router.feed.status()  # what makes a router unhealthy: router/snapshot_feed.py
        # Rate limits held locally (the registry away) do not make a router unhealthy; they show here.
        return JSONResponse({**status.body(), "rate_limits": router.fleet.status()},
                            status_code=200 if status.healthy else 503)

    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route(RESPONSES_PATH, responses, methods=["POST"])
    app.add_api_route(EMBEDDINGS_PATH, embeddings, methods=["POST"])
    for method in ("GET", "DELETE"):
        app.add_api_route(RESPONSES_PATH + "/{response_id:path}", stored_response, methods=[method],
                          operation_id=f"{method.lower()}_stored_response")
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", model, methods=["GET"])  # ids may hold "/" (org/name)
    app.add_api_route("/healthz", healthz, methods=["GET"], include_in_schema=False)
    # HEAD wherever GET is (RFC 9110), as load balancers' and uptime monitors' health checks send it; the
    # server sends the headers only. Left out of the spec, which would otherwise hold each operation twice.
    for path, endpoint in (("/v1/models", models), ("/v1/models/{model:path}", model), ("/healthz", healthz)):
        app.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    app.openapi = lambda: describe_completions(FastAPI.openapi(app))
    return app


async def _model_card(router: Router, model: str, snapshot) -> dict:
    """A /v1/models entry; `max_model_len` (the context length) comes from the model's assets, fetched
    from a site on first use, and is left out while no site serving the model answers."""
    card = {"id": model, "object": "model", "created": 0, "owned_by": "edgefire"}
    try:
        assets = await router.service.assets.get(model, snapshot, _request_id())
    except ApiError:
        return card
    if assets.context_length:
        card["max_model_len"] = assets.context_length
    return card


async def serve_completion(router: Router, chat: bool, scope, receive, send, route: str | None = None,
                           body_checked: bool = False) -> None:
    """One completion as a raw ASGI app: the response, or the error body FastAPI's handlers would give.
    `route` labels its metrics (default: chat or completions); `body_checked`: `receive` gives a body made from
    the client's, whose size its edge held to max_body_bytes (router.responses_api.ResponsesEdge)."""
    request_id = _request_id()
    context = _client_trace(scope)
    trace.bind(request_id, context)
    answered = _Answered()
    metrics = router.metrics
    metrics.requests_running.inc()
    try:
        try:
            response = await _complete(router, request_id, scope, receive, chat, answered, context, body_checked)
        except ClientDisconnect:
            return  # the client left before its answer: no one to answer
        except Exception as exc:
            response = _error_response(exc) if isinstance(exc, ApiError) else _internal_error_response(request_id, exc)
            # An error names its request and trace as an answer does: what an operator greps the logs for.
            response.headers.update({"x-request-id": request_id, "x-edgefire-trace-id": context.trace_id})
        metrics.answered(answered.model, route or ("chat" if chat else "completions"), response.status_code)
        await response(scope, receive, send)
    finally:
        metrics.requests_running.dec()


async def serve_responses(router: Router, scope, receive, send) -> None:
    """/v1/responses: the chat completion handler, its body and answer translated (router.responses_api)."""
    edge = ResponsesEdge(receive, send, router.config.max_body_bytes)
    # The edge holds the client's body to the limit; its chat translation may be longer (each input item a
    # whole message) and is not counted again.
    await serve_completion(router, True, scope, edge.receive, edge.send, route="responses", body_checked=True)


class _ResponsesAnswer(Response):
    """FastAPI's /v1/responses route answering as RouterApp does (a Response only so FastAPI passes it on)."""

    def __init__(self, router: Router) -> None:
        self._router = router
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        await serve_responses(self._router, scope, receive, send)


@dataclass(slots=True)
class _Answered:
    """What the metrics need of a request once its status is known (its model, when it was read)."""

    model: str | None = None


async def _complete(router: Router, request_id: str, scope, receive, chat: bool,
                    answered: _Answered | None = None, context: trace.TraceContext | None = None,
                    body_checked: bool = False) -> Response:
    headers = Headers(scope=scope)
    # The key first: a caller without one gets its 401 before the router reads (up to max_body_bytes of) its body.
    api_key = await router.authenticate(authorization_header(scope["headers"]))
    body = await _read_body(headers, receive, router.config.max_body_bytes, body_checked)
    request = parse_request(parse_json(body), chat)
    if answered is not None:
        answered.model = request.model
    client = scope.get("client")
    location = router.locator.locate(client[0] if client else None, headers)
    session = session_key(api_key.id, headers.get(SESSION_HEADER), request.prompt_cache_key or request.user)
    ctx = RequestContext(request_id, api_key, location, session, trace_id=context.trace_id if context else "")
    # A client that leaves while its request waits for the first token (or, not streaming, for the whole
    # answer) ends the generation there: ClientDisconnect, and the site stops generating for no one.
    watch, streaming = ClientWatch(receive), False
    try:
        async with watch.guarding():
            run = await router.service.start(request, ctx)
            log.debug("request %s: model %s prefill %s decode %s attempts %d", request_id, request.model,
                      run.generation.prefill_site, run.generation.decode_site, run.generation.num_attempts)
            if request.stream:
                streaming = True
                return SSEResponse(_sse(run), run.headers(), watch)  # which guards the stream with the same watch
            body = await run.response()
    finally:
        if not streaming:
            watch.close()
    return Response(encode_json(body).encode(), media_type="application/json", headers=run.headers())


async def _embed(router: Router, service: EmbeddingService, request_id: str, scope, receive) -> Response:
    """POST /v1/embeddings: authenticated, read and checked as completions are, then EmbeddingService; every
    answer, error or not, counted under the route "embeddings". A client that leaves before its answer ends
    the site's Embed call there (as a completion's does), and is answered by no one."""
    context = _client_trace(scope)
    trace.bind(request_id, context)
    answered = _Answered()
    router.metrics.requests_running.inc()
    try:
        try:
            headers = Headers(scope=scope)
            api_key = await router.authenticate(authorization_header(scope["headers"]))
            body = await _read_body(headers, receive, router.config.max_body_bytes)
            request = parse_embedding_request(parse_json(body))
            answered.model = request.model
            client = scope.get("client")
            location = router.locator.locate(client[0] if client else None, headers)
            session = session_key(api_key.id, headers.get(SESSION_HEADER), request.user)
            ctx = RequestContext(request_id, api_key, location, session, trace_id=context.trace_id)
            watch = ClientWatch(receive)
            try:
                async with watch.guarding():
                    answer, answer_headers = await service.embed(request, ctx)
            finally:
                watch.close()
            response = Response(encode_json(answer).encode(), media_type="application/json", headers=answer_headers)
        except ClientDisconnect:
            return Response(status_code=499)   # the client left: nothing reaches it, nothing is counted
        except Exception as exc:
            response = _error_response(exc) if isinstance(exc, ApiError) else _internal_error_response(request_id, exc)
            response.headers.update({"x-request-id": request_id, "x-edgefire-trace-id": context.trace_id})
        router.metrics.answered(answered.model, "embeddings", response.status_code)
        return response
    finally:
        router.metrics.requests_running.dec()


async def _sse(run: CompletionRun | Choices):
    """(bytes, is_last) per step for SSEResponse; [DONE] rides in the same write as the finish."""
    try:
        async with aclosing(run.chunks()) as batches:
            async for bodies in batches:
                data = b"data: " + b"\n\ndata: ".join(bodies) + b"\n\n"
                if run.finish_reason is not None:
                    yield data + b"data: [DONE]\n\n", True
                    return
                yield data, False
    except (GenerationFailed, AgentRejected) as exc:
        log.error("request %s: stream failed after %d token(s): %s", run.ctx.request_id,
                  run.num_completion_tokens, exc)
        run.metrics.streams_interrupted.inc()
        error = error_body(f"The stream broke and could not be resumed ({exc}); the text so far is incomplete.",
                           "server_error", None, "stream_interrupted")
        yield b"data: " + encode_json(error).encode() + b"\n\n", True
    except Exception as exc:  # the router's own failure: past the first byte it can only be an error event
        log.exception("request %s: stream failed in the router", run.ctx.request_id, exc_info=exc)
        yield b"data: " + encode_json(internal_error(run.ctx.request_id).body()).encode() + b"\n\n", True


async def _read_body(headers: Headers, receive, max_bytes: int, body_checked: bool = False) -> bytes:
    """The body, refused past `max_bytes` as its Content-Length declares and, unless its edge counted the client's
    bytes already (`body_checked`), as it arrives."""
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        # A compressed body was read as JSON ("not valid UTF-8"); unpacking it would also let a small
        # upload pass the body limit and inflate past it.
        raise ApiError(415, f"Content-Encoding `{encoding}` is not supported; send the request body "
                            f"uncompressed (no Content-Encoding header).", "invalid_request_error", None,
                       "unsupported_content_encoding")
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(f"The request body exceeds {max_bytes} bytes; send a smaller request.")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes and not body_checked:
            raise too_large(f"The request body exceeds {max_bytes} bytes; send a smaller request.")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _client_trace(scope) -> trace.TraceContext:
    """The client's trace with its `tracestate` (every such header: one list split over several), or a
    new trace, without the client's state: W3C trace context reads tracestate only beside a valid parent."""
    parent = trace.parse_traceparent(_single_header(scope, b"traceparent"))
    if parent is None:
        return trace.new_trace()
    states = [value.decode("latin-1") for key, value in scope["headers"] if key == b"tracestate"]
    return trace.with_state(parent, trace.parse_tracestate(states)) if states else parent


def _single_header(scope, name: bytes) -> str | None:
    """The header's value when it is sent once; None when absent or repeated (W3C trace context: more
    than one `traceparent` is invalid, and the trace restarts)."""
    try:
        return single_header(scope["headers"], name)
    except RepeatedHeader:
        return None


def _request_id() -> str:
    return "req-" + os.urandom(12).hex()


def _new_request_id(request: Request) -> str:
    request.state.request_id = request_id = _request_id()
    return request_id


def _error_response(exc: ApiError) -> Response:
    """The one response for every error, raw ASGI or FastAPI. ASCII-escaped JSON, because a message
    may quote client text (a model name) that UTF-8 cannot encode, such as a lone surrogate."""
    return Response(json.dumps(exc.body()).encode(), status_code=exc.status, headers=exc.headers(),
                    media_type="application/json")


def _internal_error_response(request_id: str, exc: Exception) -> Response:
    log.exception("request %s: unexpected failure", request_id, exc_info=exc)
    return _error_response(internal_error(request_id))


async def _api_error(_request: Request, exc: ApiError) -> Response:
    return _error_response(exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Routing's 404 and 405 say what the client asked for and what it may ask instead; a 405 keeps its
    `Allow` header (HTTP requires it)."""
    path, headers = request.url.path, exc.headers or {}
    message = {404: f"There is no `{path}` here; this endpoint serves {ENDPOINTS}.",
               405: f"`{request.method}` is not allowed on `{path}`; use {headers.get('Allow', 'another method')}."
               }.get(exc.status_code, str(exc.detail))
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    response = _error_response(ApiError(exc.status_code, message, "invalid_request_error", None, code))
    response.headers.update(headers)
    return response


async def _unexpected(request: Request, exc: Exception) -> Response:
    return _internal_error_response(getattr(request.state, "request_id", "-"), exc)
