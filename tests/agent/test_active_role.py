"""The pool planner's role change reaches a running agent: it finishes what it has, then takes only
the new role's work; no restart."""

from __future__ import annotations

import grpc
import pytest

from node_agent.proto import agent_pb2
from registry.client import RegistryClient
from tests.agent.conftest import MODEL, collect, prompt, sampling
from tests.agent.test_registry import wait_until


async def test_a_role_change_lets_running_work_finish_and_refuses_the_other_role(start_agent, connect):
    agent = await start_agent("site-a")
    client = connect(agent)
    running = client.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(30),
                                                        sampling=sampling(max_tokens=24)))
    first = await anext(aiter(running))
    agent.core.set_active_role("prefill")

    rest = await collect(running)
    assert len(first.tokens) + len(rest) == 24  # admitted before the change: runs to the end
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(client.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(20),
                                                                sampling=sampling(max_tokens=4))))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "role is prefill" in refused.value.details()
    result = await client.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt(20), sampling=sampling()))
    assert result.kv_handle
    await client.release_kv(result.kv_handle)

    agent.core.set_active_role(None)  # back to both
    assert len(await collect(client.generate(agent_pb2.GenerateRequest(
        model=MODEL, prompt_ids=prompt(20), sampling=sampling(max_tokens=4))))) == 4


async def test_a_site_configured_for_one_role_ignores_the_planner(start_agent, connect):
    agent = await start_agent("site-a", role="decode")
    agent.core.set_active_role("prefill")
    assert agent.core.role == "decode"


async def test_the_registry_answer_carries_the_role_to_the_agent(registry_server, start_agent):
    async with RegistryClient(registry_server.url, "admin-secret") as admin:
        await admin.create_site("site-a", region="eu-west", country="DE", lat=50.1, lon=8.7)
        site_token = (await admin.issue_site_token("site-a"))["token"]
    agent = await start_agent("site-a", registry_url=registry_server.url, site_token=site_token)
    assert await wait_until(lambda: _true(agent.heartbeats.num_heartbeats > 0))

    from registry.store import RegistryStore

    store = RegistryStore.open(registry_server.db_url)
    try:
        store.sites.set_active_role("site-a", "decode", "planner", {"reason": "test"})
    finally:
        store.close()
    assert await wait_until(lambda: _true(agent.core.role == "decode"))


async def _true(value: bool) -> bool:
    return value
