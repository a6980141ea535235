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
    """connect(agent or address, token=PEER_TOKEN) -> AgentClient, closed after the test."""
    clients: list[AgentClient] = []

    def make(target, token: str = PEER_TOKEN) -> AgentClient:
        client = AgentClient(target if isinstance(target, str) else target.address, token)
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
