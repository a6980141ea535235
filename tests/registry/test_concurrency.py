"""50 sites heartbeating concurrently against a real uvicorn server while an operator cordons
sites: no error, no lost update, and a final state that agrees with what each side wrote."""

from __future__ import annotations

import asyncio

from registry.client import RegistryClient

from .conftest import ADMIN_TOKEN, ROUTER_TOKEN

NUM_SITES = 50
NUM_ROUNDS = 8


async def test_heartbeats_and_cordons_do_not_lose_updates(live_server):
    admin = RegistryClient(live_server, ADMIN_TOKEN, actor="ops")
    router = RegistryClient(live_server, ROUTER_TOKEN)
    names = [f"site-{i:02d}" for i in range(NUM_SITES)]
    agents = []
    for name in names:
        await admin.create_site(name, region="eu-west", lat=50.0, lon=8.0)
        agents.append(RegistryClient(live_server, (await admin.issue_site_token(name))["token"]))
    cordoned = set(names[::3])

    async def agent_loop(index: int, agent: RegistryClient) -> None:
        for round_ in range(NUM_ROUNDS):
            await agent.heartbeat({"kv_blocks_total": 1000, "kv_blocks_free": 1000 - index - round_,
                                   "block_size": 16, "num_running": round_})
            if round_ == 2:
                await agent.register_site(names[index], f"10.0.{index}.1:50051", [{"model": "m", "role": "both"}], 5.0)

    async def operator_loop() -> None:
        for name in sorted(cordoned):
            await admin.cordon(name)
            await asyncio.sleep(0)

    try:
        await asyncio.gather(operator_loop(), *(agent_loop(i, a) for i, a in enumerate(agents)))
        snapshot, _ = await router.snapshot()
        by_name = {s["name"]: s for s in snapshot["sites"]}
        for index, name in enumerate(names):
            site = by_name[name]
            assert site["state"] == ("cordoned" if name in cordoned else "active")
            assert site["grpc_address"] == f"10.0.{index}.1:50051"  # registration did not undo the cordon
            assert site["alive"] is True
            assert site["capacity"]["kv_blocks_free"] == 1000 - index - (NUM_ROUNDS - 1)
            assert site["capacity"]["num_running"] == NUM_ROUNDS - 1
        actions = []
        cursor = None
        while True:
            page = await admin.audit_log(limit=1000, cursor=cursor)
            actions += [e["action"] for e in page["items"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert actions.count("site.cordon") == len(cordoned)
        assert actions.count("site.register") == NUM_SITES
    finally:
        for client in (admin, router, *agents):
            await client.aclose()
