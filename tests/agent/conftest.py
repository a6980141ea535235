"""Fixtures for the agent tests: agents in this process on loopback, and clients for them."""

from __future__ import annotations

import asyncio

import pytest

from node_agent.client import AgentClient
from node_agent.config import AgentConfig
from node_agent.daemon import Agent
from node_agent.proto import agent_pb2

PEER_TOKEN = "peer-secret"
MODEL = "tiny"


def agent_config(model_dir, site: str = "site-a", **overrides) -> AgentConfig:
    fields = dict(site=site, models={MODEL: str(model_dir)}, grpc_listen="127.0.0.1:0", metrics_listen=None,
                  peer_token=PEER_TOKEN, kv_cache_bytes=4 << 20, kv_chunk_bytes=2048, device="cpu",
                  dtype="float32", heartbeat_interval_s=0.2)
    fields.update(overrides)
    config = AgentConfig(**fields)
    config.validate()
    return config


@pytest.fixture
async def start_agent(tiny_model_dir):
    """start_agent(site, **config overrides) -> a started Agent; all are stopped after the test."""
    agents: list[Agent] = []

    async def start(site: str = "site-a", **overrides) -> Agent:
        agent = Agent(agent_config(tiny_model_dir, site, **overrides))
        await agent.start()
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        await agent.stop()


@pytest.fixture
async def connect():
    """connect(agent or address, token=PEER_TOKEN, credentials=None) -> AgentClient, closed after the test."""
    clients: list[AgentClient] = []

    def make(target, token: str = PEER_TOKEN, credentials=None) -> AgentClient:
        client = AgentClient(target if isinstance(target, str) else target.address, token, credentials=credentials)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


def sampling(max_tokens: int = 12, temperature: float = 0.0, seed: int | None = None, **fields) -> agent_pb2.SamplingParams:
    params = agent_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True, **fields)
    if seed is not None:
        params.seed = seed
    return params


def prompt(n: int = 40, start: int = 7) -> list[int]:
    return [(start + 13 * i) % 500 + 5 for i in range(n)]


async def collect(call) -> list[int]:
    return [token.token_id async for chunk in call for token in chunk.tokens]


async def wait_for_free_blocks(client: AgentClient, expected: int, timeout_s: float = 5.0) -> int:
    """Free KV blocks once they reach `expected` (frees land a moment after a stream ends)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        health = await client.health()
        if health.kv_blocks_free == expected and health.num_kv_leases == 0:
            return health.kv_blocks_free
        if asyncio.get_running_loop().time() > deadline:
            return health.kv_blocks_free
        await asyncio.sleep(0.05)


class RegistryServer:
    """The real registry service under uvicorn on a fixed loopback port, in a thread; restartable."""

    def __init__(self, db_url: str, port: int, admin_token: str, router_token: str):
        self.db_url, self.port = db_url, port
        self.tokens = (admin_token, router_token)
        self.url = f"http://127.0.0.1:{port}"
        self._server = None
        self._thread = None

    def start(self) -> None:
        import socket
        import threading
        import time

        import uvicorn

        from registry.service import create_app

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        app = create_app(self.db_url, *self.tokens)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("registry did not start")
            time.sleep(0.01)
        self._socket = sock

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()


@pytest.fixture
def registry_server(tmp_path, unused_tcp_port):
    from registry.migrate import upgrade_to_head

    db_url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade_to_head(db_url)
    server = RegistryServer(db_url, unused_tcp_port, "admin-secret", "router-secret")
    server.start()
    yield server
    if server._thread.is_alive():
        server.stop()


def generate_request(index: int, max_tokens: int = 10, **fields) -> agent_pb2.GenerateRequest:
    """Request `index` of a batch: a prompt of its own, greedy."""
    return agent_pb2.GenerateRequest(request_id=f"r{index}", model=MODEL, prompt_ids=prompt(20 + index, start=index),
                                     sampling=sampling(max_tokens), **fields)


@pytest.fixture
async def session_client():
    """session_client(agent) -> an AgentClient sending Generate and Decode over one Session stream."""
    clients: list[AgentClient] = []

    def make(agent) -> AgentClient:
        client = AgentClient(agent.address, PEER_TOKEN, sessions=True)
        clients.append(client)
        return client

    yield make
    for client in clients:
        assert client.sessions, "the client fell back to per-request calls: the agent has no Session RPC"
        await client.close()
