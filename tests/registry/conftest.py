"""Fixtures for the registry tests: every store and service test runs on SQLite and PostgreSQL.

PostgreSQL (127.0.0.1:5432, db `test`, user `postgres`, or $EDGEFIRE_TEST_PG_URL) gets one fresh
schema per test session, dropped afterwards; tables are truncated between tests. A missing
PostgreSQL is an error, never a skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
import uuid
from urllib.parse import quote

import httpx
import psycopg
import pytest
import uvicorn

from registry.client import RegistryClient
from registry.db import make_engine
from registry.http_head import HeadLimitedHttp
from registry.migrate import upgrade_to_head
from registry.service import create_app
from registry.store import RegistryStore
from registry.wire import CapacityReport

PG_URL = os.environ.get("EDGEFIRE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
ADMIN_TOKEN = "admin-secret"
ROUTER_TOKEN = "router-secret"
TABLES = ("sites, site_models, capacity, links, api_keys, site_tokens, audit_log, leases, placements, "
          "fleet_routers, rate_usage, rate_holds, key_usage, site_tombstones")


def capacity(total: int, free: int, block_size: int, **fields) -> CapacityReport:
    """A heartbeat's capacity, written the short way."""
    return CapacityReport(kv_blocks_total=total, kv_blocks_free=free, block_size=block_size, **fields)


class FakeClock:
    """A settable clock, so liveness can be tested without sleeping."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def pg_libpq_url() -> str:
    return PG_URL.replace("postgresql+psycopg://", "postgresql://")


def pg_schema_url(schema: str) -> str:
    return f"{PG_URL}?options={quote(f'-csearch_path={schema}')}"


def new_pg_schema() -> str:
    schema = f"edgefire_registry_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(pg_libpq_url(), autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"')
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is required for the registry tests and is unreachable at {PG_URL}: {exc}")
    return schema


def drop_pg_schema(schema: str) -> None:
    with psycopg.connect(pg_libpq_url(), autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture(scope="session")
def pg_session_url():
    schema = new_pg_schema()
    url = pg_schema_url(schema)
    upgrade_to_head(url)
    yield url
    drop_pg_schema(schema)


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db_url(request, tmp_path):
    """A database with no schema yet (the SQLite file in a directory not made yet)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'sub' / 'registry.db'}"
        return
    schema = new_pg_schema()
    yield pg_schema_url(schema)
    drop_pg_schema(schema)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory):
    path = tmp_path_factory.mktemp("registry-template") / "registry.db"
    upgrade_to_head(f"sqlite:///{path}")
    return path


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path, sqlite_template):
    """A migrated, empty registry database."""
    if request.param == "sqlite":
        path = tmp_path / "registry.db"
        shutil.copy(sqlite_template, path)
        return f"sqlite:///{path}"
    url = request.getfixturevalue("pg_session_url")
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")
        conn.exec_driver_sql("UPDATE registry_version SET version = 1")
    engine.dispose()
    return url


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(db_url, clock):
    registry_store = RegistryStore(make_engine(db_url), clock)
    yield registry_store
    registry_store.close()


@pytest.fixture
def sqlite_store(tmp_path, sqlite_template, clock):
    """A store on SQLite alone, for tests whose subject is not the database (a module takes it as `store`)."""
    path = tmp_path / "registry.db"
    shutil.copy(sqlite_template, path)
    registry_store = RegistryStore(make_engine(f"sqlite:///{path}"), clock)
    yield registry_store
    registry_store.close()


@pytest.fixture
async def app(db_url, store):
    """The service in-process, lifespan running (heartbeat batcher started)."""
    application = create_app(db_url, ADMIN_TOKEN, ROUTER_TOKEN, store=store, max_body_bytes=64 * 1024)
    async with application.router.lifespan_context(application):
        yield application


@pytest.fixture
async def connect(app):
    """connect(token) -> RegistryClient talking to the in-process service."""
    clients: list[RegistryClient] = []

    def make(token: str, actor: str | None = None) -> RegistryClient:
        client = RegistryClient("http://registry", token, actor=actor, transport=httpx.ASGITransport(app))
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()


@pytest.fixture
def admin(connect) -> RegistryClient:
    return connect(ADMIN_TOKEN, actor="alice")


@pytest.fixture
def router_client(connect) -> RegistryClient:
    return connect(ROUTER_TOKEN)


@pytest.fixture
def raw(app) -> httpx.AsyncClient:
    """A bare HTTP client for requests the RegistryClient would never send."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://registry")


async def new_site(admin: RegistryClient, connect, name: str = "fra-1", **fields) -> RegistryClient:
    """Creates a site and returns a client holding its agent token."""
    await admin.create_site(name, **{"region": "eu-west", "country": "DE", "lat": 50.1, "lon": 8.7, **fields})
    token = (await admin.issue_site_token(name))["token"]
    return connect(token)


class ServerThread:
    """uvicorn on a free loopback port, in a thread of this process."""

    def __init__(self, app) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, http=HeadLimitedHttp, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *_exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.socket.close()


@pytest.fixture
def live_server(db_url, store):
    """The service under a real uvicorn server on loopback; yields its base URL."""
    application = create_app(db_url, ADMIN_TOKEN, ROUTER_TOKEN, store=store)
    with ServerThread(application) as server:
        yield server.url
