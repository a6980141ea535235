"""Shared-token authentication for the agent's gRPC API, on both sides of a call.

Every call carries one `authorization: Bearer <peer token>` entry; the server interceptor compares
the token in constant time and answers UNAUTHENTICATED before any handler runs. The header is read
as the registry and the routers read theirs: the scheme in any case, the token with its surrounding
spaces dropped. A call carrying the entry twice is refused, whichever of them holds the token: which
one a hop in between added is not knowable here.
"""

from __future__ import annotations

import hmac

import grpc
from grpc import aio


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _rejecting_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only answers UNAUTHENTICATED."""
    if handler.response_streaming:
        async def reject_stream(_request, context: aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # unreachable; makes this an async generator like the method it stands in for

        return grpc.unary_stream_rpc_method_handler(reject_stream, handler.request_deserializer,
                                                    handler.response_serializer)

    async def reject_unary(_request, context: aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.unary_unary_rpc_method_handler(reject_unary, handler.request_deserializer,
                                               handler.response_serializer)


def refusal(metadata, expected: bytes) -> str | None:
    """Why a call's metadata does not carry the peer token (None: it does)."""
    presented = [value for key, value in metadata or () if key == "authorization"]
    if not presented:
        return "missing authorization metadata; send 'authorization: Bearer <peer token>'"
    if len(presented) > 1:
        return "send one authorization metadata entry, not several"
    scheme, _, token = str(presented[0]).partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
        return "the bearer token is not valid for this agent"
    return None


class TokenAuthInterceptor(aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = token.encode()

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        message = refusal(handler_call_details.invocation_metadata, self._expected)
        handler = await continuation(handler_call_details)
        if message is None or handler is None:
            return handler
        return _rejecting_handler(handler, message)
