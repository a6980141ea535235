"""The one place that turns router failures into OpenAI error bodies.

Every error a client can see is an `ApiError`; the constructors below fix its status, type and
code so handlers never spell them out. `error_body` is also used for the in-band SSE error event.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        challenge = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}  # RFC 9110: every 401 names its scheme
        if self.retry_after_s is None:
            return challenge
        return {**challenge, "Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def bad_api_key() -> ApiError:
    return ApiError(401, "Incorrect or missing API key; send `Authorization: Bearer <key>`.",
                    "invalid_request_error", None, "invalid_api_key")


def unknown_model(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist or no site serves it; see GET /v1/models.",
                    "invalid_request_error", "model", "model_not_found")


def not_in_regions(model: str, allowed_regions: frozenset[str], serving_regions: tuple[str, ...]) -> ApiError:
    """403 as OpenAI answers a request from a region it does not serve (`request_forbidden`): the model
    exists, and retrying cannot help (the SDK retries 503s, never a 403); the key's regions must change."""
    return ApiError(403, f"The model `{model}` is served only in regions this API key may not use (it may use "
                         f"{', '.join(sorted(allowed_regions))}; the model is served in {', '.join(serving_regions)}). "
                         f"Ask the operator to allow one of those regions for this key, or pick a model "
                         f"GET /v1/models lists.", "request_forbidden", "model", "model_not_in_allowed_regions")


def too_large(message: str, param: str | None = None) -> ApiError:
    return ApiError(413, message, "invalid_request_error", param, "request_too_large")


def rate_limited(message: str, retry_after_s: float) -> ApiError:
    return ApiError(429, message, "rate_limit_error", None, "rate_limit_exceeded", retry_after_s)


def no_capacity(message: str, retry_after_s: float) -> ApiError:
    return ApiError(503, message, "service_unavailable_error", None, "no_capacity", retry_after_s)


def internal_error(request_id: str) -> ApiError:
    return ApiError(500, f"The router failed on this request (request id {request_id}).", "server_error",
                    None, "internal_error")
