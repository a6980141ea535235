"""Router test fixtures: a real registry service (SQLite, in-process), fake agents, and routers.

Everything runs in the test's event loop: the registry over httpx's ASGI transport, agents as
grpc.aio servers on loopback ports, the router under uvicorn on a loopback port.
"""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest
from router_fake_agent import MODEL, FakeAgent, model_info_from_dir, word_token_ids

from engine.tokenizer import ChatTokenizer
from registry.client import RegistryClient
from registry.migrate import upgrade_to_head
from registry.service import create_app
from router.config import RouterConfig
from router.server import Router
from tests.engine.chat_checkpoints import write_template_tokenizer

ADMIN_TOKEN = "admin-secret"
ROUTER_TOKEN = "router-secret"
IDLE = {"kv_blocks_total": 1000, "kv_blocks_free": 1000, "block_size": 16}


@pytest.fixture(scope="session")
def model_info(tiny_model_dir):
    return model_info_from_dir(tiny_model_dir)


@pytest.fixture(scope="session")
def words(model_info):
    return word_token_ids(model_info)


@pytest.fixture(scope="session")
def registry_template(tmp_path_factory):
    path = tmp_path_factory.mktemp("router-registry") / "registry.db"
    upgrade_to_head(f"sqlite:///{path}")
    return path


class Cluster:
    """A registry with sites whose agents are FakeAgents."""

    def __init__(self, app, model_info, words) -> None:
        self.app = app
        self.model_info = model_info
        self.words = words
        self.admin = self.client(ADMIN_TOKEN)
        self.agents: dict[str, FakeAgent] = {}
        self._clients: list[RegistryClient] = [self.admin]

    def client(self, token: str) -> RegistryClient:
        client = RegistryClient("http://registry", token, transport=httpx.ASGITransport(self.app))
        if hasattr(self, "_clients"):
            self._clients.append(client)
        return client

    async def add_site(self, name: str, lat: float, lon: float, region: str = "eu", role: str = "both",
                       heartbeat: bool = True, credentials=None, **capacity) -> FakeAgent:
        """A site whose FakeAgent serves plaintext gRPC, or TLS with `credentials` (grpc.ServerCredentials)."""
        agent = await FakeAgent(name, self.model_info, self.words).start(credentials)
        self.agents[name] = agent
        await self.admin.create_site(name, region=region, country="XX", lat=lat, lon=lon,
                                     grpc_address=agent.address, models=[{"model": MODEL, "role": role}],
                                     heartbeat_interval_s=60)
        if heartbeat:
            await self.heartbeat(name, **capacity)
        return agent

    async def heartbeat(self, name: str, **capacity) -> None:
        token = (await self.admin.issue_site_token(name))["token"]
        await self.client(token).heartbeat({**IDLE, **capacity})

    async def create_key(self, **fields) -> str:
        return (await self.admin.create_api_key("test-key", **fields))["key"]

    async def close(self) -> None:
        for agent in self.agents.values():
            await agent.stop()
        for client in self._clients:
            await client.aclose()


@pytest.fixture
async def cluster(tmp_path, registry_template, model_info, words):
    path = tmp_path / "registry.db"
    shutil.copy(registry_template, path)
    app = create_app(f"sqlite:///{path}", ADMIN_TOKEN, ROUTER_TOKEN)
    async with app.router.lifespan_context(app):
        cluster = Cluster(app, model_info, words)
        yield cluster
        await cluster.close()


@pytest.fixture
async def make_router(cluster):
    """make_router(**config) -> (router, base_url), serving on loopback, snapshot loaded."""
    routers: list[Router] = []

    async def make(**settings) -> tuple[Router, str]:
        defaults = {"host": "127.0.0.1", "port": 0, "lat": 50.1, "lon": 8.7, "snapshot_refresh_s": 0.2,
                    "first_token_timeout_s": 2.0, "token_idle_timeout_s": 2.0}
        config = RouterConfig(**{**defaults, **settings})
        router = Router(config, registry=cluster.client(ROUTER_TOKEN))
        await router.start()
        routers.append(router)
        return router, await router.start_server()

    yield make
    for router in routers:
        await router.stop()


@pytest.fixture
async def client(cluster, make_router):
    """The official openai client (async) on a router over one site (fra) and a new API key."""
    await cluster.add_site("fra", 50.1, 8.7)
    key = await cluster.create_key()
    _router, url = await make_router()
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        yield client


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=20) as client:
        yield client


@pytest.fixture(scope="module")
def template_tokenizer(tmp_path_factory):
    """template name -> ChatTokenizer with that template's control tokens (trained once per module)."""
    made: dict[str, ChatTokenizer] = {}

    def get(name: str) -> ChatTokenizer:
        if name not in made:
            made[name] = ChatTokenizer.from_dir(write_template_tokenizer(tmp_path_factory.mktemp("tpl"), name))
        return made[name]
    return get
