"""The agent's /metrics counts every checked credential, so an operator rotating a token sees when no
one presents the old one any more (deploy/README.md, Tokens): accepted calls and KV data connections by
port, role and credential (the first 8 hex digits of the token's SHA-256, never the token), refusals by
port and reason."""

from __future__ import annotations

import grpc
import pytest
from grpc import aio
from prometheus_client.parser import text_string_to_metric_families

from engine.errors import EngineError
from node_agent.auth import PEER, ROUTER, RoleTokens, TokenAuthInterceptor, token_digest
from node_agent.kv_data import KVDataServer, probe
from node_agent.metrics import AgentMetrics
from node_agent.proto import agent_pb2, agent_pb2_grpc

from .conftest import MODEL, PEER_TOKEN, collect, prompt, sampling

AGENT_TOKEN, OLD_AGENT_TOKEN = "efag-new-router-secret", "efag-old-router-secret"
OLD_PEER_TOKEN = "old-peer-secret"
SECRETS = (AGENT_TOKEN, OLD_AGENT_TOKEN, PEER_TOKEN, OLD_PEER_TOKEN)


def credential(token: str) -> str:
    """What an operator computes to find a token's series: `printf %s TOKEN | sha256sum | cut -c1-8`."""
    return token_digest(token)[:8]


def rotating_tokens() -> RoleTokens:
    return RoleTokens(PEER_TOKEN, [token_digest(OLD_AGENT_TOKEN), token_digest(AGENT_TOKEN)],
                      accept_peer_tokens=[OLD_PEER_TOKEN])


def samples(metrics: AgentMetrics, name: str) -> dict[tuple[str, ...], float]:
    """name's samples as /metrics serves them: label values (sorted by label name) -> value."""
    found = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(value for _key, value in sorted(sample.labels.items()))] = sample.value
    return found


def accepted(metrics: AgentMetrics) -> dict[tuple[str, str, str], float]:
    """(port, role, credential) -> accepted calls."""
    return {(port, role, cred): value
            for (cred, port, role), value in samples(metrics, "edgefire_agent_accepted_calls_total").items()}


def refused(metrics: AgentMetrics) -> dict[tuple[str, str], float]:
    return samples(metrics, "edgefire_agent_refused_calls_total")


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


class HealthOnly(agent_pb2_grpc.AgentServicer):
    async def Health(self, request, context):
        return agent_pb2.HealthResponse()


@pytest.fixture
async def counted_stub():
    metrics = AgentMetrics()
    server = aio.server(interceptors=[TokenAuthInterceptor(rotating_tokens(), metrics)])
    agent_pb2_grpc.add_AgentServicer_to_server(HealthOnly(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    yield agent_pb2_grpc.AgentStub(channel), metrics
    await channel.close()
    await server.stop(None)


async def code_of(call) -> grpc.StatusCode:
    try:
        await call
    except aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_each_accepted_token_has_its_own_series_and_an_unused_one_stays_flat(counted_stub):
    stub, metrics = counted_stub
    calls = {OLD_AGENT_TOKEN: 1, AGENT_TOKEN: 3, PEER_TOKEN: 2, OLD_PEER_TOKEN: 1}
    for token, count in calls.items():
        for _ in range(count):
            assert await code_of(stub.Health(agent_pb2.HealthRequest(), metadata=bearer(token))) == grpc.StatusCode.OK
    assert accepted(metrics) == {
        ("grpc", ROUTER, credential(OLD_AGENT_TOKEN)): 1, ("grpc", ROUTER, credential(AGENT_TOKEN)): 3,
        ("grpc", PEER, credential(PEER_TOKEN)): 2, ("grpc", PEER, credential(OLD_PEER_TOKEN)): 1}

    # The routers moved to the new agent token: the old one's series no longer grows.
    for _ in range(4):
        await stub.Health(agent_pb2.HealthRequest(), metadata=bearer(AGENT_TOKEN))
    assert accepted(metrics)[("grpc", ROUTER, credential(OLD_AGENT_TOKEN))] == 1
    assert accepted(metrics)[("grpc", ROUTER, credential(AGENT_TOKEN))] == 7


async def test_refused_calls_are_counted_by_reason(counted_stub):
    stub, metrics = counted_stub
    assert await code_of(stub.Health(agent_pb2.HealthRequest(), metadata=bearer("stranger"))) \
        == grpc.StatusCode.UNAUTHENTICATED
    assert await code_of(stub.Health(agent_pb2.HealthRequest())) == grpc.StatusCode.UNAUTHENTICATED
    for token in (PEER_TOKEN, OLD_PEER_TOKEN):
        assert await code_of(stub.GetModelInfo(agent_pb2.ModelInfoRequest(model=MODEL), metadata=bearer(token))) \
            == grpc.StatusCode.PERMISSION_DENIED
    assert refused(metrics) == {("grpc", "unauthenticated"): 2, ("grpc", "permission_denied"): 2}
    assert accepted(metrics) == {}  # a refused call is not an accepted one, whatever token it held


async def test_the_kv_data_port_counts_its_connections_by_credential():
    async def no_such_lease(kv_handle: str):
        raise EngineError(f"KV handle {kv_handle!r} is unknown, released or expired")

    metrics = AgentMetrics()
    server = KVDataServer(rotating_tokens(), no_such_lease, lambda *_: None, lambda _n: None, observer=metrics)
    address = f"127.0.0.1:{await server.start('127.0.0.1')}"
    try:
        for token in (PEER_TOKEN, PEER_TOKEN, OLD_PEER_TOKEN):
            assert (await probe(address, token, 64, timeout=5)).num_bytes == 64
        for token in (AGENT_TOKEN, "stranger", OLD_PEER_TOKEN[:-1] + "!"):
            with pytest.raises(EngineError, match="missing or wrong peer token"):
                await probe(address, token, 64, timeout=5)
    finally:
        await server.stop()
    assert accepted(metrics) == {("kv_data", PEER, credential(PEER_TOKEN)): 2,
                                 ("kv_data", PEER, credential(OLD_PEER_TOKEN)): 1}
    assert refused(metrics) == {("kv_data", "unauthenticated"): 3}


async def test_the_metrics_name_tokens_by_digest_prefix_only(counted_stub):
    stub, metrics = counted_stub
    for token in SECRETS:
        await stub.Health(agent_pb2.HealthRequest(), metadata=bearer(token))
    text = metrics.render().decode()
    for token in SECRETS:
        assert token not in text
        assert token_digest(token) not in text  # the prefix only, not the digest an agent holds
        assert credential(token) in text


def test_the_credential_label_is_the_same_whatever_the_position_in_the_lists():
    """One token keeps its series across a rotation's steps, which reorder and shorten the lists."""
    during = RoleTokens(PEER_TOKEN, [token_digest(OLD_AGENT_TOKEN), token_digest(AGENT_TOKEN)],
                        accept_peer_tokens=[OLD_PEER_TOKEN])
    after = RoleTokens(OLD_PEER_TOKEN, token_digest(AGENT_TOKEN), accept_peer_tokens=[PEER_TOKEN])
    for token in (AGENT_TOKEN, PEER_TOKEN, OLD_PEER_TOKEN):
        assert during.match(token.encode()).credential == after.match(token.encode()).credential == credential(token)
    assert after.match(OLD_AGENT_TOKEN.encode()).credential is None


async def test_a_split_request_between_real_agents_is_counted_on_each_port(start_agent, connect):
    """The daemon wires the counters: the router's calls under the agent token on gRPC, the decode site's
    pull under the peer token on the source's data port."""
    digest = token_digest(AGENT_TOKEN)
    a = await start_agent("site-a", agent_token_sha256=digest)
    b = await start_agent("site-b", agent_token_sha256=digest)
    router_a, router_b = connect(a, AGENT_TOKEN), connect(b, AGENT_TOKEN)
    params, prompt_ids = sampling(), prompt(30)
    result = await router_a.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids, sampling=params))
    await collect(router_b.decode(agent_pb2.DecodeRequest(
        model=MODEL, prompt_ids=prompt_ids, generated_ids=[result.first_token.token_id], sampling=params,
        kv_source=agent_pb2.KVSource(address=a.address, kv_handle=result.kv_handle))))
    assert b.metrics.kv_fallbacks._value.get() == 0
    source = accepted(a.metrics)
    assert source[("grpc", ROUTER, credential(AGENT_TOKEN))] >= 1        # Prefill
    assert source[("kv_data", PEER, credential(PEER_TOKEN))] == 1        # the pull
    assert accepted(b.metrics)[("grpc", ROUTER, credential(AGENT_TOKEN))] >= 1  # Decode
    assert refused(a.metrics) == refused(b.metrics) == {}
