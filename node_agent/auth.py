"""Shared-token authentication for the agent's gRPC API, on both sides of a call.

Every call carries `authorization: Bearer <peer token>`; the server interceptor compares it in
constant time and answers UNAUTHENTICATED before any handler runs.
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


class TokenAuthInterceptor(aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization")
        if presented is not None and hmac.compare_digest(presented.encode(), self._expected):
            return await continuation(handler_call_details)
        message = ("missing authorization metadata; send 'authorization: Bearer <peer token>'" if presented is None
                   else "the bearer token is not valid for this agent")
        handler = await continuation(handler_call_details)
        return None if handler is None else _rejecting_handler(handler, message)
