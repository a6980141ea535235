"""Token rotation with no refused call: a fleet of live agents behind two routers serving requests
continuously moves from one token for everything to split tokens, as deploy/README.md (Tokens) says.

The fleet: two prefill-only and two decode-only sites (so every request is split and its KV pulled
with the peer token over the data port), registered with a real registry, and two routers placing
requests from its snapshot. Processes are restarted one at a time as in a real rollout: an agent is
cordoned, the routers' views updated, the requests already placed on it finished, then it restarts
with its new settings and is uncordoned; a router is taken out of the clients' rotation, its requests
finished, then it restarts. After every restart each (prefill, decode) pair serves a split request
directly, with each token the routers may present at that moment. Nothing may be refused: every
request is answered, no router fails over or resumes, no decode site recomputes a prefill.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import httpx
import pytest
from grpc import aio

from engine.errors import EngineError
from node_agent.auth import token_digest
from node_agent.client import AgentClient
from node_agent.daemon import Agent
from node_agent.kv_data import probe
from node_agent.proto import agent_pb2
from registry.client import RegistryClient
from registry.migrate import upgrade_to_head
from router.config import RouterConfig
from router.server import Router

from .conftest import MODEL, RegistryServer, agent_config, collect, prompt, sampling

ADMIN_TOKEN, REGISTRY_ROUTER_TOKEN = "admin-secret", "router-secret"
SINGLE_TOKEN = "ef-single-fleet-token"   # before the split: the agents' peer_token, the routers' agent_token
NEW_PEER_TOKEN = "efp-new-peer-token"
NEW_AGENT_TOKEN = "efag-new-agent-token"
REGISTRY_PORT = 48220
# site -> (role, lat, lon, gRPC port, KV data port); the routers stand in Frankfurt
SITES = {"lis": ("prefill", 38.7, -9.1, 48200, 48210), "mad": ("prefill", 40.4, -3.7, 48201, 48211),
         "fra": ("decode", 50.1, 8.7, 48202, 48212), "par": ("decode", 48.9, 2.3, 48203, 48213)}
PREFILL_SITES = [name for name, spec in SITES.items() if spec[0] == "prefill"]
DECODE_SITES = [name for name, spec in SITES.items() if spec[0] == "decode"]
# deploy/README.md, Tokens: "From one token to split tokens". Each agent step is rolled out site by site.
AGENT_STEPS = [
    ("1. every agent accepts the new peer token", dict(peer_token=SINGLE_TOKEN, accept_peer_tokens=[NEW_PEER_TOKEN])),
    ("2. every agent sends the new peer token", dict(peer_token=NEW_PEER_TOKEN, accept_peer_tokens=[SINGLE_TOKEN])),
    ("3. every agent splits, taking the old token and the new agent token from routers",
     dict(peer_token=NEW_PEER_TOKEN, agent_token_sha256=[token_digest(SINGLE_TOKEN), token_digest(NEW_AGENT_TOKEN)])),
]
LAST_STEP = ("5. every agent drops the old token",
             dict(peer_token=NEW_PEER_TOKEN, agent_token_sha256=token_digest(NEW_AGENT_TOKEN)))


class Fleet:
    """The registry, the agents and the routers, with the rollout operations an operator uses."""

    def __init__(self, model_dir: Path, registry_url: str, admin: RegistryClient):
        self.model_dir, self.registry_url, self.admin = model_dir, registry_url, admin
        self.agents: dict[str, Agent] = {}
        self.stopped_agents: list[Agent] = []
        self.site_tokens: dict[str, str] = {}
        self.routers: list[Router] = []       # in the clients' rotation
        self.stopped_routers: list[Router] = []
        self._registry_clients: list[RegistryClient] = []

    async def add_site(self, name: str, settings: dict) -> None:
        _role, lat, lon, _port, _data_port = SITES[name]
        await self.admin.create_site(name, region="eu-west", country="PT", lat=lat, lon=lon)
        self.site_tokens[name] = (await self.admin.issue_site_token(name))["token"]
        await self.start_agent(name, settings)

    async def start_agent(self, name: str, settings: dict) -> None:
        role, lat, lon, port, data_port = SITES[name]
        config = agent_config(self.model_dir, name, role=role, lat=lat, lon=lon, region="eu-west",
                              grpc_listen=f"127.0.0.1:{port}", kv_data_port=data_port,
                              registry_url=self.registry_url, site_token=self.site_tokens[name],
                              heartbeat_interval_s=0.5, **settings)
        agent = Agent(config)
        self.agents[name] = agent
        await agent.start()

    async def start_router(self, agent_token: str) -> Router:
        registry = RegistryClient(self.registry_url, REGISTRY_ROUTER_TOKEN)
        self._registry_clients.append(registry)
        router = Router(RouterConfig(host="127.0.0.1", port=0, lat=50.1, lon=8.7, snapshot_refresh_s=0.2,
                                     agent_token=agent_token, first_token_timeout_s=30, token_idle_timeout_s=30,
                                     placement_report_interval_s=0),
                        registry=registry)
        await router.start()
        router.url = await router.start_server()
        self.routers.append(router)
        return router

    async def wait_for_routers(self, name: str, state: str, alive: bool) -> None:
        """Until every router in rotation places with a view in which the site has this state and liveness."""
        for router in self.routers:
            for _ in range(200):
                site = next((s for s in router.feed.current().sites if s.name == name), None)
                if site is not None and site.state == state and site.alive == alive:
                    break
                await asyncio.sleep(0.05)
                await router.feed.refresh()
            else:
                pytest.fail(f"router never saw {name} {state} (alive={alive})")

    async def restart_agent(self, name: str, settings: dict, load: Load) -> None:
        await self.admin.cordon(name)
        await self.wait_for_routers(name, "cordoned", alive=True)
        await load.settle()  # what was placed on it before the routers knew
        agent = self.agents.pop(name)
        await agent.stop()
        self.stopped_agents.append(agent)
        await self.start_agent(name, settings)
        await self.admin.uncordon(name)
        await self.wait_for_routers(name, "active", alive=True)

    async def restart_router(self, router: Router, agent_token: str, load: Load) -> None:
        self.routers.remove(router)  # the clients' front stops sending it requests
        await load.settle()
        await router.stop()
        self.stopped_routers.append(router)
        await self.start_router(agent_token)

    def all_agents(self) -> list[Agent]:
        return [*self.agents.values(), *self.stopped_agents]

    def all_routers(self) -> list[Router]:
        return [*self.routers, *self.stopped_routers]

    async def close(self) -> None:
        for router in self.routers:
            await router.stop()
        for agent in self.agents.values():
            await agent.stop()
        for client in self._registry_clients:
            await client.aclose()


class Load:
    """Clients sending completions without pause to the routers in rotation, round robin."""

    def __init__(self, fleet: Fleet, api_key: str, num_workers: int = 2):
        self.fleet, self.api_key, self.num_workers = fleet, api_key, num_workers
        self.answers: list[tuple[int, str, str, str]] = []  # (status, body, prefill site, decode site)
        self.in_flight: set[asyncio.Task] = set()
        self._stopping = False
        self._workers: list[asyncio.Task] = []
        self._http = httpx.AsyncClient(timeout=60)
        self._turn = 0

    def start(self) -> None:
        self._workers = [asyncio.create_task(self._work(i)) for i in range(self.num_workers)]

    async def _work(self, worker: int) -> None:
        while not self._stopping:
            router = self.fleet.routers[self._turn % len(self.fleet.routers)]
            self._turn += 1
            request = asyncio.create_task(self._send(router.url, worker))
            self.in_flight.add(request)
            try:
                await request
            finally:
                self.in_flight.discard(request)

    async def _send(self, url: str, worker: int) -> None:
        body = {"model": MODEL, "prompt": f"request {len(self.answers)} from client {worker}", "max_tokens": 4,
                "temperature": 0}
        response = await self._http.post(f"{url}/v1/completions", json=body,
                                         headers={"Authorization": f"Bearer {self.api_key}"})
        self.answers.append((response.status_code, response.text, response.headers.get("x-edgefire-prefill-site", ""),
                             response.headers.get("x-edgefire-decode-site", "")))

    async def settle(self) -> None:
        """Until every request sent so far is answered."""
        if self.in_flight:
            await asyncio.wait(set(self.in_flight))

    async def stop(self) -> None:
        self._stopping = True
        await asyncio.gather(*self._workers)
        await self._http.aclose()


def metric_total(registry, name: str) -> float:
    return sum(sample.value for family in registry.collect() for sample in family.samples if sample.name == name)


async def assert_every_pair_serves_a_split_request(fleet: Fleet, router_tokens: list[str]) -> None:
    """Each (prefill, decode) pair, with each token a router may present now: the decode site pulls the
    KV from the prefill site with its own peer token (nothing recomputed)."""
    for token in router_tokens:
        for prefill_site in PREFILL_SITES:
            for decode_site in DECODE_SITES:
                source, sink = fleet.agents[prefill_site], fleet.agents[decode_site]
                fallbacks = sink.metrics.kv_fallbacks._value.get()
                async with AgentClient(source.address, token) as router_a, AgentClient(sink.address, token) as router_b:
                    params, prompt_ids = sampling(max_tokens=4), prompt(24, start=len(prefill_site + decode_site))
                    result = await router_a.prefill(agent_pb2.PrefillRequest(model=MODEL, prompt_ids=prompt_ids,
                                                                             sampling=params), timeout=30)
                    decoded = await collect(router_b.decode(agent_pb2.DecodeRequest(
                        model=MODEL, prompt_ids=prompt_ids, generated_ids=[result.first_token.token_id],
                        sampling=params, kv_source=agent_pb2.KVSource(address=source.address,
                                                                      kv_handle=result.kv_handle)), timeout=30))
                assert len(decoded) == 3
                assert sink.metrics.kv_fallbacks._value.get() == fallbacks, (prefill_site, decode_site)


@pytest.fixture
async def fleet(tmp_path, tiny_model_dir):
    db_url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade_to_head(db_url)
    registry = RegistryServer(db_url, REGISTRY_PORT, ADMIN_TOKEN, REGISTRY_ROUTER_TOKEN)
    registry.start()
    admin = RegistryClient(registry.url, ADMIN_TOKEN)
    fleet = Fleet(tiny_model_dir, registry.url, admin)
    try:
        yield fleet
    finally:
        await fleet.close()
        await admin.aclose()
        registry.stop()


async def test_a_single_token_fleet_splits_its_tokens_while_serving(fleet, caplog):
    for name in SITES:
        await fleet.add_site(name, dict(peer_token=SINGLE_TOKEN))
    for _ in range(2):
        await fleet.start_router(agent_token=SINGLE_TOKEN)
    for name in SITES:
        await fleet.wait_for_routers(name, "active", alive=True)
    load = Load(fleet, (await fleet.admin.create_api_key("rotation"))["key"])
    load.start()

    router_tokens = [SINGLE_TOKEN]
    with caplog.at_level(logging.WARNING, logger="node_agent.daemon"):
        for _step, settings in AGENT_STEPS:
            for name in SITES:
                await fleet.restart_agent(name, settings, load)
                await assert_every_pair_serves_a_split_request(fleet, router_tokens)
        # 4. every router, one at a time, presents the new agent token
        for router in list(fleet.routers):
            await fleet.restart_router(router, NEW_AGENT_TOKEN, load)
            await assert_every_pair_serves_a_split_request(fleet, [SINGLE_TOKEN, NEW_AGENT_TOKEN])
        router_tokens = [NEW_AGENT_TOKEN]
        caplog.clear()
        for name in SITES:
            await fleet.restart_agent(name, LAST_STEP[1], load)
            await assert_every_pair_serves_a_split_request(fleet, router_tokens)
    await load.settle()
    num_answers = len(load.answers)
    await load.stop()

    # Every request answered, every one split, none failed over, resumed or recomputed.
    assert num_answers >= 20
    assert [(status, body) for status, body, *_ in load.answers if status != 200] == []
    assert all(prefill in PREFILL_SITES and decode in DECODE_SITES for _s, _b, prefill, decode in load.answers)
    for router in fleet.all_routers():
        for name in ("edgefire_router_failovers_total", "edgefire_router_resumes_total",
                     "edgefire_router_site_failures_total", "edgefire_router_streams_interrupted_total"):
            assert metric_total(router.metrics.registry, name) == 0, name
    assert sum(agent.metrics.kv_fallbacks._value.get() for agent in fleet.all_agents()) == 0
    assert sum(agent.metrics.kv_bytes_received._value.get() for agent in fleet.all_agents()) > 0
    # The split fleet holds no trace of a rotation any more: no warning at the last restarts.
    assert "accept_peer_tokens" not in caplog.text and "agent_token_sha256" not in caplog.text

    # The end state: the old token opens nothing, the new peer token nothing of a router's.
    agent = fleet.agents["lis"]
    for token, method, code in ((SINGLE_TOKEN, "health", grpc.StatusCode.UNAUTHENTICATED),
                                (NEW_PEER_TOKEN, "model_info", grpc.StatusCode.PERMISSION_DENIED)):
        async with AgentClient(agent.address, token) as client:
            with pytest.raises(aio.AioRpcError) as refused:
                await (client.health() if method == "health" else client.model_info(MODEL))
        assert refused.value.code() == code
    data_address = f"127.0.0.1:{SITES['lis'][4]}"
    with pytest.raises(EngineError, match="missing or wrong peer token"):
        await probe(data_address, SINGLE_TOKEN, 64, timeout=5)
    assert (await probe(data_address, NEW_PEER_TOKEN, 64, timeout=5)).num_bytes == 64
