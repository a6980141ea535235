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


def _reject(message: str) -> grpc.RpcMethodHandler:
    async def abort_unary(_request, context: aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_stream(_request, context: aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, to match server-streaming methods

    return abort_unary, abort_stream


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
        if handler is None:
            return None
        abort_unary, abort_stream = _reject(message)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(abort_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(abort_unary, handler.request_deserializer,
                                                   handler.response_serializer)
