"""Who may call an agent: every gRPC method and the KV data port against every credential.

Only the peer token opens them. Tokens of the other roles (the registry's admin, router and site
tokens, a client's API key) are refused like a wrong one, before any handler runs; the header is
read as the registry and routers read theirs, and an ambiguous call (two authorization entries) is
refused whichever of them holds the token.
"""

from __future__ import annotations

import grpc
import pytest
from grpc import aio

from engine.errors import EngineError
from node_agent.auth import TokenAuthInterceptor
from node_agent.kv_data import KVDataServer, probe, receive_bulk
from node_agent.proto import agent_pb2, agent_pb2_grpc

from .conftest import PEER_TOKEN

OTHER_ROLES = {"admin": "h17-admin-token", "router": "efr-router-token", "site": "efs-site-token",
               "api_key": "ef-client-key", "near_miss": PEER_TOKEN + "x", "prefix": PEER_TOKEN[:-1]}
# method -> (request, streams its answer)
CALLS = {
    "Health": (agent_pb2.HealthRequest(), False),
    "GetModelInfo": (agent_pb2.ModelInfoRequest(model="tiny"), False),
    "Generate": (agent_pb2.GenerateRequest(model="tiny", prompt_ids=[1, 2]), True),
    "Prefill": (agent_pb2.PrefillRequest(model="tiny", prompt_ids=[1, 2]), False),
    "FetchKV": (agent_pb2.FetchKVRequest(kv_handle="h"), True),
    "ReleaseKV": (agent_pb2.ReleaseKVRequest(kv_handle="h"), False),
    "Decode": (agent_pb2.DecodeRequest(model="tiny", prompt_ids=[1, 2]), True),
    "Drain": (agent_pb2.DrainRequest(), False),
}


class HealthOnly(agent_pb2_grpc.AgentServicer):
    """Answers Health; every other method is the generated UNIMPLEMENTED, which shows a call got past auth."""

    async def Health(self, request, context):
        return agent_pb2.HealthResponse()


@pytest.fixture
async def stub():
    server = aio.server(interceptors=[TokenAuthInterceptor(PEER_TOKEN)])
    agent_pb2_grpc.add_AgentServicer_to_server(HealthOnly(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    yield agent_pb2_grpc.AgentStub(channel)
    await channel.close()
    await server.stop(None)


async def status_of(stub, method: str, metadata) -> grpc.StatusCode:
    request, streaming = CALLS[method]
    try:
        call = getattr(stub, method)(request, metadata=metadata, timeout=5)
        if streaming:
            async for _ in call:
                pass
        else:
            await call
    except aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def test_every_method_opens_to_the_peer_token_only(stub):
    for method in CALLS:
        assert await status_of(stub, method, bearer(PEER_TOKEN)) in (grpc.StatusCode.OK, grpc.StatusCode.UNIMPLEMENTED)
        assert await status_of(stub, method, ()) == grpc.StatusCode.UNAUTHENTICATED, method
        for role, token in OTHER_ROLES.items():
            assert await status_of(stub, method, bearer(token)) == grpc.StatusCode.UNAUTHENTICATED, (method, role)


@pytest.mark.parametrize("authorization", [PEER_TOKEN, f"Basic {PEER_TOKEN}", "Bearer", f"Bearer{PEER_TOKEN}",
                                           f"Token {PEER_TOKEN}"])
async def test_malformed_headers_are_refused(stub, authorization):
    assert await status_of(stub, "Health", (("authorization", authorization),)) == grpc.StatusCode.UNAUTHENTICATED


async def test_the_scheme_is_case_insensitive_as_on_the_registry_and_routers(stub):
    for authorization in (f"bearer {PEER_TOKEN}", f"BEARER {PEER_TOKEN}", f"Bearer  {PEER_TOKEN}"):
        assert await status_of(stub, "Health", (("authorization", authorization),)) == grpc.StatusCode.OK


async def test_two_authorization_entries_are_refused_in_either_order(stub):
    for entries in ((f"Bearer {PEER_TOKEN}", "Bearer wrong"), ("Bearer wrong", f"Bearer {PEER_TOKEN}"),
                    (f"Bearer {PEER_TOKEN}", f"Bearer {PEER_TOKEN}")):
        metadata = tuple(("authorization", value) for value in entries)
        try:
            await stub.Health(agent_pb2.HealthRequest(), metadata=metadata, timeout=5)
        except aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED and "one authorization" in exc.details()
        else:
            pytest.fail(f"a call with two authorization entries was served: {entries}")


async def test_refusals_never_echo_the_token(stub):
    for token in (PEER_TOKEN + "x", OTHER_ROLES["admin"]):
        try:
            await stub.Health(agent_pb2.HealthRequest(), metadata=bearer(token), timeout=5)
        except aio.AioRpcError as exc:
            assert token not in exc.details() and PEER_TOKEN not in exc.details()


@pytest.fixture
async def data_port():
    async def no_such_lease(kv_handle: str):
        raise EngineError(f"KV handle {kv_handle!r} is unknown, released or expired")

    server = KVDataServer(PEER_TOKEN, no_such_lease, lambda *_: None, lambda _n: None)
    port = await server.start("127.0.0.1")
    yield f"127.0.0.1:{port}"
    await server.stop()


async def test_the_kv_data_port_opens_to_the_peer_token_only(data_port):
    assert (await probe(data_port, PEER_TOKEN, 64, timeout=5)).num_bytes == 64
    with pytest.raises(EngineError, match="unknown, released or expired"):
        await receive_bulk(data_port, PEER_TOKEN, "no-such-handle", None, [], timeout=5)
    for role, token in {**OTHER_ROLES, "empty": "", "bearer": f"Bearer {PEER_TOKEN}"}.items():
        with pytest.raises(EngineError, match="missing or wrong peer token"):
            await probe(data_port, token, 64, timeout=5)
        with pytest.raises(EngineError, match="missing or wrong peer token") as refused:
            await receive_bulk(data_port, token, "no-such-handle", None, [], timeout=5)
        assert PEER_TOKEN not in str(refused.value), role
