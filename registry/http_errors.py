"""The one place that turns failures into HTTP error bodies:
{"error": {"message": str, "type": str, "code": str}} with a fitting 4xx (or 5xx) status.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from registry.errors import Conflict, InvalidInput, NotFound, RegistryStoreError

log = logging.getLogger(__name__)

_STORE_STATUS = {InvalidInput: (422, "invalid_request_error"), NotFound: (404, "not_found_error"),
                 Conflict: (409, "conflict_error")}
_HTTP_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error", 410: "authentication_error",
               413: "request_too_large", 415: "invalid_request_error", 422: "invalid_request_error"}


class ApiError(Exception):
    """`fields`: what a program reading the error needs beyond its message (e.g. which site was deleted,
    when and by whom), added to the error object beside message, type and code."""

    def __init__(self, status: int, message: str, code: str, headers: dict[str, str] | None = None,
                 fields: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers
        self.fields = fields


def error_body(message: str, type_: str, code: str, fields: dict | None = None) -> dict:
    # A message can quote the caller's input; a lone surrogate in it could not be encoded as UTF-8.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {**(fields or {}), "message": message, "type": type_, "code": code}}


def error_response(status: int, message: str, code: str, headers: dict[str, str] | None = None,
                   fields: dict | None = None) -> JSONResponse:
    body = error_body(message, _HTTP_TYPES.get(status, "api_error"), code, fields)
    return JSONResponse(body, status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    for exc_class, handler in _handlers().items():
        app.add_exception_handler(exc_class, handler)


async def response_for(request: Request, exc: Exception) -> JSONResponse:
    """The error response the app would give for `exc` (for the heartbeat fast path, which runs
    outside FastAPI's exception handling); re-raises what no handler covers."""
    handlers = _handlers()
    for exc_class in type(exc).__mro__:
        if exc_class in handlers:
            return await handlers[exc_class](request, exc)
    raise exc


def _handlers() -> dict:
    return {ApiError: _api_error, RegistryStoreError: _store_error, RequestValidationError: _validation_error,
            StarletteHTTPException: _http_error, OperationalError: _database_down}


async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.code, exc.headers, exc.fields)


async def _store_error(_request: Request, exc: RegistryStoreError) -> JSONResponse:
    status, type_ = _STORE_STATUS.get(type(exc), (400, "invalid_request_error"))
    return JSONResponse(error_body(exc.message, type_, exc.code), status_code=status)


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(*validation_problem(exc.errors()))


def validation_problem(errors: list[dict]) -> tuple[int, str, str]:
    """(status, message, code) for a body that failed validation: 400 when it is not JSON at all,
    else 422 naming the first field at fault ("request body" when the body itself is) and what is wrong."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return 400, "the request body is not valid JSON", "invalid_json"
    first = errors[0] if errors else {}
    message = f"{_field_of(first)}: {_problem(first)}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return 422, message, "invalid_field"


# What each kind of pydantic error means to the caller; "{got}" is the value sent, as JSON.
_PROBLEMS = {
    "missing": "required field is missing",
    "extra_forbidden": "is not a field of this request (check its spelling)",
    "int_type": "must be an integer (a JSON number without a decimal point: 5, not 5.0 or \"5\"), got {got}",
    "float_type": "must be a number (not a string or a boolean), got {got}",
    "bool_type": "must be true or false (not a string or a number), got {got}",
    "string_type": "must be a string, got {got}",
    "list_type": "must be a JSON array, got {got}",
    "dict_type": "must be a JSON object, got {got}",
    "model_type": "must be a JSON object, got {got}",
    "model_attributes_type": "must be a JSON object, got {got}",
}
_MAX_SHOWN = 60  # characters of a wrong value quoted back


def _field_of(error: dict) -> str:
    """`models[0].role` for a body field, `limit (query parameter)` for a parameter."""
    source, *path = error.get("loc", ()) or ("body",)
    if source not in ("body", "query", "path", "header", "cookie"):
        source, path = "body", [source, *path]   # a model validated outside FastAPI (the heartbeat's)
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")
    if source != "body":
        return f"{where} ({source} parameter)"
    return where or "request body"


def _problem(error: dict) -> str:
    if error.get("type") == "missing" and tuple(error.get("loc", ())) == ("body",):
        return "missing; send a JSON object"
    template = _PROBLEMS.get(error.get("type", ""))
    if template is None:
        return error.get("msg", "invalid value")
    return template.format(got=_shown(error.get("input")))


def _shown(value) -> str:
    text = json.dumps(value, default=repr, ensure_ascii=False)
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN - 3] + "..."


async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "no_such_endpoint", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, str(exc.detail), code, getattr(exc, "headers", None))


def status_of(exc: Exception) -> int:
    """The HTTP status the handlers answer `exc` with (500 for what none covers)."""
    if isinstance(exc, ApiError):
        return exc.status
    if isinstance(exc, RegistryStoreError):
        return _STORE_STATUS.get(type(exc), (400, ""))[0]
    if isinstance(exc, RequestValidationError):
        return validation_problem(exc.errors())[0]
    if isinstance(exc, StarletteHTTPException):
        return exc.status_code
    return 503 if isinstance(exc, OperationalError) else 500


async def _database_down(request: Request, exc: OperationalError) -> JSONResponse:
    log.error("registry database error on %s %s: %s", request.method, request.url.path, exc.orig)
    app = request.scope.get("app")
    if app is not None:
        app.state.registry.metrics.db_errors.inc()
    return JSONResponse(error_body("the registry database is unavailable; retry shortly", "api_error", "database_unavailable"),
                        status_code=503, headers={"Retry-After": "1"})
