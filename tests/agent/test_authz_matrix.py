"""Who may call an agent: every gRPC method and the KV data port against every credential.

Split by role (node_agent.auth): the agent token (routers) opens Generate, Prefill, Decode,
GetModelInfo and Drain; the peer token (agents) opens FetchKV and the KV data port; Health and
ReleaseKV take either. A valid token of the other role is PERMISSION_DENIED with the token the method
takes named; a missing or unknown one is UNAUTHENTICATED. Tokens of other services (the registry's
admin, router and site tokens, a client's API key) are refused like a wrong one, before any handler
runs. An agent configured with the peer token alone (before the split) opens every method to it.
The header is read as the registry and routers read theirs, and an ambiguous call (two authorization
entries) is refused whichever of them holds the token.
"""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc import aio

from engine.errors import EngineError
from node_agent.auth import METHOD_ROLES, PEER, ROUTER, RoleTokens, TokenAuthInterceptor, token_digest
from node_agent.kv_data import KVDataServer, probe, receive_bulk
from node_agent.proto import agent_pb2, agent_pb2_grpc

from .conftest import MODEL, PEER_TOKEN, collect, prompt, sampling

AGENT_TOKEN = "efag-router-secret"
OTHER_ROLES = {"admin": "h17-admin-token", "registry_router": "efr-router-token", "site": "efs-site-token",
               "api_key": "ef-client-key", "near_miss": PEER_TOKEN + "x", "prefix": PEER_TOKEN[:-1],
               "agent_near_miss": AGENT_TOKEN + "x", "agent_digest": token_digest(AGENT_TOKEN)}
ROLE_TOKENS = {ROUTER: AGENT_TOKEN, PEER: PEER_TOKEN}
# method -> (request, streams its answer)
CALLS = {
    "Health": (agent_pb2.HealthRequest(), False),
    "GetModelInfo": (agent_pb2.ModelInfoRequest(model="tiny"), False),
    "Generate": (agent_pb2.GenerateRequest(model="tiny", prompt_ids=[1, 2]), True),
    "Prefill": (agent_pb2.PrefillRequest(model="tiny", prompt_ids=[1, 2]), False),
    "FetchKV": (agent_pb2.FetchKVRequest(kv_handle="h"), True),
    "ReleaseKV": (agent_pb2.ReleaseKVRequest(kv_handle="h"), False),
    "Decode": (agent_pb2.DecodeRequest(model="tiny", prompt_ids=[1, 2]), True),
    "Session": ([agent_pb2.SessionRequest()], True),
    "Embed": (agent_pb2.EmbedRequest(model="tiny", inputs=[agent_pb2.EmbedInput(token_ids=[1, 2])]), False),
    "Drain": (agent_pb2.DrainRequest(), False),
}
PASSED = (grpc.StatusCode.OK, grpc.StatusCode.UNIMPLEMENTED)  # UNIMPLEMENTED: the call got past auth


class HealthOnly(agent_pb2_grpc.AgentServicer):
    """Answers Health; every other method is the generated UNIMPLEMENTED, which shows a call got past auth."""

    async def Health(self, request, context):
        return agent_pb2.HealthResponse()


async def serve_stub(*role_tokens_args, **role_tokens_kwargs):
    server = aio.server(interceptors=[TokenAuthInterceptor(RoleTokens(*role_tokens_args, **role_tokens_kwargs))])
    agent_pb2_grpc.add_AgentServicer_to_server(HealthOnly(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, aio.insecure_channel(f"127.0.0.1:{port}")


@pytest.fixture
async def stub():
    """An agent split by role: it holds the peer token and the agent token's digest."""
    server, channel = await serve_stub(PEER_TOKEN, token_digest(AGENT_TOKEN))
    yield agent_pb2_grpc.AgentStub(channel)
    await channel.close()
    await server.stop(None)


@pytest.fixture
async def single_token_stub():
    """An agent configured as before the split: the peer token alone."""
    server, channel = await serve_stub(PEER_TOKEN)
    yield agent_pb2_grpc.AgentStub(channel)
    await channel.close()
    await server.stop(None)


async def refusal_of(stub, method: str, metadata) -> tuple[grpc.StatusCode, str]:
    request, streaming = CALLS[method]
    try:
        call = getattr(stub, method)(request, metadata=metadata, timeout=5)
        if streaming:
            async for _ in call:
                pass
        else:
            await call
    except aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def status_of(stub, method: str, metadata) -> grpc.StatusCode:
    return (await refusal_of(stub, method, metadata))[0]


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def test_every_method_of_the_service_has_its_roles():
    methods = {m.name for m in agent_pb2.DESCRIPTOR.services_by_name["Agent"].methods}
    assert methods == set(METHOD_ROLES) == set(CALLS)


async def test_each_method_opens_to_its_roles_token_only(stub):
    for method in CALLS:
        for role, token in ROLE_TOKENS.items():
            code, details = await refusal_of(stub, method, bearer(token))
            if role in METHOD_ROLES[method]:
                assert code in PASSED, (method, role, details)
            else:
                assert code == grpc.StatusCode.PERMISSION_DENIED, (method, role)
        assert await status_of(stub, method, ()) == grpc.StatusCode.UNAUTHENTICATED, method
        for role, token in OTHER_ROLES.items():
            assert await status_of(stub, method, bearer(token)) == grpc.StatusCode.UNAUTHENTICATED, (method, role)


@pytest.mark.parametrize("method", ["Generate", "Prefill", "Decode", "Session", "Embed", "GetModelInfo", "Drain"])
async def test_the_peer_token_cannot_act_as_a_router(stub, method):
    """What a compromised site could do to its peers with the token it holds to pull KV: nothing here."""
    code, details = await refusal_of(stub, method, bearer(PEER_TOKEN))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert f"{method} takes the agent token" in details and "not the peer token" in details
    assert PEER_TOKEN not in details and AGENT_TOKEN not in details


async def test_the_agent_token_cannot_pull_kv(stub):
    code, details = await refusal_of(stub, "FetchKV", bearer(AGENT_TOKEN))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "FetchKV takes the peer token" in details and "not the agent token" in details


async def test_a_missing_token_is_told_which_token_the_method_takes(stub):
    code, details = await refusal_of(stub, "FetchKV", ())
    assert code == grpc.StatusCode.UNAUTHENTICATED and "the peer token" in details and "agent token" not in details
    code, details = await refusal_of(stub, "Drain", ())
    assert code == grpc.StatusCode.UNAUTHENTICATED and "the agent token" in details and "peer token" not in details


async def test_a_single_token_agent_opens_every_method_to_its_peer_token(single_token_stub):
    for method in CALLS:
        assert await status_of(single_token_stub, method, bearer(PEER_TOKEN)) in PASSED, method
        assert await status_of(single_token_stub, method, ()) == grpc.StatusCode.UNAUTHENTICATED, method
        for role, token in {**OTHER_ROLES, "agent": AGENT_TOKEN}.items():
            status = await status_of(single_token_stub, method, bearer(token))
            assert status == grpc.StatusCode.UNAUTHENTICATED, (method, role)


@pytest.mark.parametrize("authorization", [PEER_TOKEN, f"Basic {PEER_TOKEN}", "Bearer", f"Bearer{PEER_TOKEN}",
                                           f"Token {PEER_TOKEN}", f"Bearer{AGENT_TOKEN}", AGENT_TOKEN])
async def test_malformed_headers_are_refused(stub, authorization):
    assert await status_of(stub, "Health", (("authorization", authorization),)) == grpc.StatusCode.UNAUTHENTICATED


async def test_the_scheme_is_case_insensitive_as_on_the_registry_and_routers(stub):
    for token in (PEER_TOKEN, AGENT_TOKEN):
        for authorization in (f"bearer {token}", f"BEARER {token}", f"Bearer  {token}"):
            assert await status_of(stub, "Health", (("authorization", authorization),)) == grpc.StatusCode.OK


async def test_two_authorization_entries_are_refused_in_either_order(stub):
    for entries in ((f"Bearer {PEER_TOKEN}", "Bearer wrong"), ("Bearer wrong", f"Bearer {PEER_TOKEN}"),
                    (f"Bearer {PEER_TOKEN}", f"Bearer {PEER_TOKEN}"), (f"Bearer {AGENT_TOKEN}", f"Bearer {PEER_TOKEN}")):
        metadata = tuple(("authorization", value) for value in entries)
        try:
            await stub.Health(agent_pb2.HealthRequest(), metadata=metadata, timeout=5)
        except aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED and "one authorization" in exc.details()
        else:
            pytest.fail(f"a call with two authorization entries was served: {entries}")


async def test_refusals_never_echo_a_token(stub):
    for method in CALLS:
        for token in (PEER_TOKEN + "x", OTHER_ROLES["admin"], PEER_TOKEN, AGENT_TOKEN):
            _code, details = await refusal_of(stub, method, bearer(token))
            assert token not in details and PEER_TOKEN not in details and AGENT_TOKEN not in details


def test_an_agent_token_equal_to_the_peer_token_is_refused():
    with pytest.raises(ValueError, match="must differ"):
        RoleTokens(PEER_TOKEN, token_digest(PEER_TOKEN))


@pytest.fixture
async def data_port():
    async def no_such_lease(kv_handle: str):
        raise EngineError(f"KV handle {kv_handle!r} is unknown, released or expired")

    server = KVDataServer(RoleTokens(PEER_TOKEN, token_digest(AGENT_TOKEN)), no_such_lease, lambda *_: None,
                          lambda _n: None)
    port = await server.start("127.0.0.1")
    yield f"127.0.0.1:{port}"
    await server.stop()


async def test_the_kv_data_port_opens_to_the_peer_token_only(data_port):
    assert (await probe(data_port, PEER_TOKEN, 64, timeout=5)).num_bytes == 64
    with pytest.raises(EngineError, match="unknown, released or expired"):
        await receive_bulk(data_port, PEER_TOKEN, "no-such-handle", None, [], timeout=5)
    refused = {**OTHER_ROLES, "agent": AGENT_TOKEN, "empty": "", "bearer": f"Bearer {PEER_TOKEN}"}
    for role, token in refused.items():
        with pytest.raises(EngineError, match="missing or wrong peer token") as probed:
            await probe(data_port, token, 64, timeout=5)
        assert "takes the peer token only" in str(probed.value), role
        with pytest.raises(EngineError, match="missing or wrong peer token") as pulled:
            await receive_bulk(data_port, token, "no-such-handle", None, [], timeout=5)
        assert PEER_TOKEN not in str(pulled.value) and AGENT_TOKEN not in str(pulled.value), role


# -- rotation: several tokens of a role at once ----------------------------------------------------

OLD_AGENT_TOKEN, OLD_PEER_TOKEN = "efag-old-router-secret", "old-peer-secret"
ROTATING = {ROUTER: (OLD_AGENT_TOKEN, AGENT_TOKEN), PEER: (PEER_TOKEN, OLD_PEER_TOKEN)}


def rotating_tokens() -> RoleTokens:
    """Mid-rotation of both tokens: two agent token digests, and a peer token accepted beside the one sent."""
    return RoleTokens(PEER_TOKEN, [token_digest(OLD_AGENT_TOKEN), token_digest(AGENT_TOKEN)],
                      accept_peer_tokens=[OLD_PEER_TOKEN])


@pytest.fixture
async def rotating_stub():
    server, channel = await serve_stub(PEER_TOKEN, [token_digest(OLD_AGENT_TOKEN), token_digest(AGENT_TOKEN)],
                                       accept_peer_tokens=[OLD_PEER_TOKEN])
    yield agent_pb2_grpc.AgentStub(channel)
    await channel.close()
    await server.stop(None)


async def test_every_accepted_token_opens_its_roles_methods_only(rotating_stub):
    strangers = {**OTHER_ROLES, "old_agent_digest": token_digest(OLD_AGENT_TOKEN),
                 "old_peer_prefix": OLD_PEER_TOKEN[:-1], "old_agent_near_miss": OLD_AGENT_TOKEN + "x"}
    for method in CALLS:
        for role, tokens in ROTATING.items():
            for token in tokens:
                code, details = await refusal_of(rotating_stub, method, bearer(token))
                if role in METHOD_ROLES[method]:
                    assert code in PASSED, (method, token, details)
                else:
                    assert code == grpc.StatusCode.PERMISSION_DENIED, (method, token)
                    assert token not in details
        for name, token in strangers.items():
            code = await status_of(rotating_stub, method, bearer(token))
            assert code == grpc.StatusCode.UNAUTHENTICATED, (method, name)


async def test_a_single_token_agent_opens_every_method_to_each_peer_token_it_accepts():
    """Before the split every peer token is the key to everything, as the one token was: a fleet can move
    to a new peer token before it splits (deploy/README.md, Tokens)."""
    server, channel = await serve_stub(PEER_TOKEN, accept_peer_tokens=[OLD_PEER_TOKEN])
    stub = agent_pb2_grpc.AgentStub(channel)
    try:
        for method in CALLS:
            for token in (PEER_TOKEN, OLD_PEER_TOKEN):
                assert await status_of(stub, method, bearer(token)) in PASSED, (method, token)
            assert await status_of(stub, method, bearer(AGENT_TOKEN)) == grpc.StatusCode.UNAUTHENTICATED, method
    finally:
        await channel.close()
        await server.stop(None)


@pytest.mark.parametrize("peer_token, digests, accepted", [
    (PEER_TOKEN, [token_digest(AGENT_TOKEN), token_digest(PEER_TOKEN)], []),
    (PEER_TOKEN, [token_digest(AGENT_TOKEN), token_digest(OLD_PEER_TOKEN)], [OLD_PEER_TOKEN]),
    (PEER_TOKEN, token_digest(OLD_PEER_TOKEN), [OLD_PEER_TOKEN]),
])
def test_no_accepted_agent_token_may_be_an_accepted_peer_token(peer_token, digests, accepted):
    with pytest.raises(ValueError, match="must differ"):
        RoleTokens(peer_token, digests, accept_peer_tokens=accepted)


def test_an_empty_peer_token_is_never_accepted():
    with pytest.raises(ValueError, match="must not be empty"):
        RoleTokens(PEER_TOKEN, accept_peer_tokens=[""])


def test_every_candidate_is_compared_whichever_matches(monkeypatch):
    """No early exit: the first accepted token, the last one and a stranger cost the same comparisons, so
    the time taken does not tell which token (or role) a guess came close to."""
    import node_agent.auth as auth

    tokens = rotating_tokens()
    compared: list[int] = []
    real = auth.hmac.compare_digest

    def counting(a, b):
        compared.append(len(a))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    counts = {}
    for token in (PEER_TOKEN, OLD_PEER_TOKEN, OLD_AGENT_TOKEN, AGENT_TOKEN, "stranger"):
        compared.clear()
        tokens.roles_of(token.encode())
        counts[token] = list(compared)
    assert set(map(tuple, counts.values())) == {(32, 32, 32, 32)}  # two peer and two agent digests, always


@pytest.fixture
async def rotating_data_port():
    async def no_such_lease(kv_handle: str):
        raise EngineError(f"KV handle {kv_handle!r} is unknown, released or expired")

    server = KVDataServer(rotating_tokens(), no_such_lease, lambda *_: None, lambda _n: None)
    port = await server.start("127.0.0.1")
    yield f"127.0.0.1:{port}"
    await server.stop()


async def test_the_kv_data_port_accepts_the_peer_tokens_fetchkv_accepts(rotating_data_port, rotating_stub):
    for token in ROTATING[PEER]:
        assert (await probe(rotating_data_port, token, 64, timeout=5)).num_bytes == 64
        assert await status_of(rotating_stub, "FetchKV", bearer(token)) in PASSED
    same_length = OLD_PEER_TOKEN[:-1] + chr(ord(OLD_PEER_TOKEN[-1]) + 1)
    for token in (*ROTATING[ROUTER], same_length, PEER_TOKEN + OLD_PEER_TOKEN, ""):
        with pytest.raises(EngineError, match="missing or wrong peer token"):
            await probe(rotating_data_port, token, 64, timeout=5)
        assert await status_of(rotating_stub, "FetchKV", bearer(token)) not in PASSED


# -- real agents -----------------------------------------------------------------------------------

async def test_split_agents_serve_a_split_request_with_each_token_in_its_place(start_agent, connect, caplog):
    """The router's calls carry the agent token, the decode site pulls the KV with the peer token (over
    the data port, nothing recomputed), and the tokens equal a colocated run's; the peer token a site
    holds opens none of the router's methods on its peer."""
    digest = token_digest(AGENT_TOKEN)
    with caplog.at_level(logging.WARNING, logger="node_agent.daemon"):
        a = await start_agent("site-a", agent_token_sha256=digest)
        b = await start_agent("site-b", agent_token_sha256=digest)
    assert "agent_token_sha256 is not set" not in caplog.text
    router_a, router_b = connect(a, AGENT_TOKEN), connect(b, AGENT_TOKEN)
    params, prompt_ids = sampling(), prompt(40)
    colocated = await collect(router_a.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt_ids,
                                                                          sampling=params)))
    result = await router_a.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids, sampling=params))
    decoded = await collect(router_b.decode(agent_pb2.DecodeRequest(
        model=MODEL, prompt_ids=prompt_ids, generated_ids=[result.first_token.token_id], sampling=params,
        kv_source=agent_pb2.KVSource(address=a.address, kv_handle=result.kv_handle))))
    assert [result.first_token.token_id, *decoded] == colocated
    assert b.metrics.kv_bytes_received._value.get() == result.kv_bytes > 0
    assert b.metrics.kv_fallbacks._value.get() == 0

    peer = connect(a, PEER_TOKEN)
    for call in (peer.drain(deadline_s=1.0),
                 collect(peer.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt_ids,
                                                                 sampling=params))),
                 peer.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids, sampling=params))):
        with pytest.raises(aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (await peer.health()).status == agent_pb2.HealthResponse.SERVING  # not drained
    with pytest.raises(aio.AioRpcError) as refused:
        await collect(router_a.fetch_kv("any-handle"))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def split_equals_colocated(client_a, client_b, a, prompt_ids: list[int]) -> None:
    """A prefill on `a` decoded on the other site gives the tokens a colocated run on `a` gives."""
    params = sampling()
    colocated = await collect(client_a.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt_ids,
                                                                          sampling=params)))
    result = await client_a.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids, sampling=params))
    decoded = await collect(client_b.decode(agent_pb2.DecodeRequest(
        model=MODEL, prompt_ids=prompt_ids, generated_ids=[result.first_token.token_id], sampling=params,
        kv_source=agent_pb2.KVSource(address=a.address, kv_handle=result.kv_handle))))
    assert [result.first_token.token_id, *decoded] == colocated


async def test_a_single_token_agent_serves_as_before_and_warns_once(start_agent, connect, caplog):
    with caplog.at_level(logging.WARNING, logger="node_agent.daemon"):
        a = await start_agent("site-a")
        b = await start_agent("site-b")
    warnings = [r for r in caplog.records if "agent_token_sha256 is not set" in r.getMessage()]
    assert [r.levelno for r in warnings] == [logging.WARNING] * 2
    assert "peer token also opens the router methods" in warnings[0].getMessage()
    await split_equals_colocated(connect(a, PEER_TOKEN), connect(b, PEER_TOKEN), a, prompt(40, start=3))
    assert b.metrics.kv_fallbacks._value.get() == 0


async def test_an_agent_split_before_its_peer_still_serves_the_split_request_by_recomputing(start_agent, connect):
    """Mid-rollout: the decode site's peer token is not its source's. The pull is refused, the decode
    site recomputes (same tokens), and it says why in its fallback count rather than failing the request."""
    a = await start_agent("site-a", agent_token_sha256=token_digest(AGENT_TOKEN))
    b = await start_agent("site-b", peer_token="another-peer-token", agent_token_sha256=token_digest(AGENT_TOKEN))
    await split_equals_colocated(connect(a, AGENT_TOKEN), connect(b, AGENT_TOKEN), a, prompt(30, start=5))
    assert b.metrics.kv_fallbacks._value.get() == 1



async def test_an_agent_mid_rotation_says_so_at_start_without_naming_a_token(start_agent, caplog):
    """Extra accepted tokens widen who gets in; the warning is there so that they do not outlast the rotation."""
    with caplog.at_level(logging.WARNING, logger="node_agent.daemon"):
        await start_agent("site-a", agent_token_sha256=[token_digest(OLD_AGENT_TOKEN), token_digest(AGENT_TOKEN)],
                          accept_peer_tokens=[OLD_PEER_TOKEN])
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("agent_token_sha256 lists 2 agent token digests" in m for m in messages), messages
    assert any("accept_peer_tokens: 1 peer token(s) accepted beside peer_token" in m for m in messages), messages
    for secret in (OLD_AGENT_TOKEN, AGENT_TOKEN, OLD_PEER_TOKEN, PEER_TOKEN, token_digest(AGENT_TOKEN)):
        assert secret not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="node_agent.daemon"):
        await start_agent("site-b", agent_token_sha256=token_digest(AGENT_TOKEN))
    assert "agent_token_sha256" not in caplog.text and "accept_peer_tokens" not in caplog.text
