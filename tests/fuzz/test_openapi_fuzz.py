"""Schema-driven fuzzing (schemathesis) of the router's and the registry's OpenAPI specs: whatever a
client with valid credentials sends, in or out of the schema, the answer is never a 5xx.

Both services run on loopback from their own event-loop thread (the router against a real registry
and a fake agent serving one model, so completions reach tokenization and placement); schemathesis
calls them over HTTP from the test thread. The run is bounded and derandomized: the same examples
every run, `EDGEFIRE_FUZZ_EXAMPLES` per operation and mode (raise it to search harder).
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import httpx
import pytest
import requests
import schemathesis
import uvicorn
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from deploy.processes import free_port
from registry.client import RegistryClient
from registry.migrate import upgrade_to_head
from registry.service import create_app
from router.config import RouterConfig
from router.server import Router
from tests.router.router_fake_agent import MODEL, FakeAgent, model_info_from_dir, word_token_ids

ADMIN_TOKEN = "fuzz-admin-token"
ROUTER_TOKEN = "fuzz-router-token"
EXAMPLES = int(os.environ.get("EDGEFIRE_FUZZ_EXAMPLES", "5"))
REQUEST_TIMEOUT_S = 20


class Services:
    """A registry, a fake agent and a router serving from one background event loop."""

    def __init__(self, tmp_path: Path, model_dir: Path) -> None:
        self.tmp_path, self.model_dir = tmp_path, model_dir
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-services", daemon=True)
        self.registry_url = self.router_url = ""
        self.site_token = self.api_key = ""

    def __enter__(self) -> Services:
        self.thread.start()
        self._run(self._start())
        return self

    def __exit__(self, *exc) -> None:
        self._run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    async def _start(self) -> None:
        db_url = f"sqlite:///{self.tmp_path / 'registry.db'}"
        upgrade_to_head(db_url)
        port = free_port()
        self.registry_server = uvicorn.Server(uvicorn.Config(
            create_app(db_url, ADMIN_TOKEN, ROUTER_TOKEN), host="127.0.0.1", port=port, log_level="warning"))
        self.registry_task = asyncio.create_task(self.registry_server.serve())
        while not self.registry_server.started:
            await asyncio.sleep(0.02)
        self.registry_url = f"http://127.0.0.1:{port}"
        info = model_info_from_dir(self.model_dir)
        self.agent = await FakeAgent("fra", info, word_token_ids(info)).start()
        self.agent.eos_at = 8  # every answer ends by the ninth token: the fuzzer's time goes to requests
        async with RegistryClient(self.registry_url, ADMIN_TOKEN) as admin:
            await admin.create_site("fra", region="eu", country="DE", lat=50.1, lon=8.7, grpc_address=self.agent.address,
                                    models=[{"model": MODEL, "role": "both"}], heartbeat_interval_s=600)
            site_token = (await admin.issue_site_token("fra"))["token"]
            self.api_key = (await admin.create_api_key("fuzz"))["key"]
        async with RegistryClient(self.registry_url, site_token) as site:
            await site.heartbeat({"kv_blocks_total": 1000, "kv_blocks_free": 1000, "block_size": 16})
        self.site_token = site_token
        self.router = Router(RouterConfig(host="127.0.0.1", port=0, registry_url=self.registry_url,
                                          registry_token=ROUTER_TOKEN, lat=50.1, lon=8.7, snapshot_refresh_s=0.5,
                                          first_token_timeout_s=5, token_idle_timeout_s=5))
        await self.router.start()
        self.router_url = await self.router.start_server()

    async def _stop(self) -> None:
        await self.router.stop()
        await self.agent.stop()
        self.registry_server.should_exit = True
        await self.registry_task


@pytest.fixture(scope="module")
def services(tmp_path_factory, tiny_model_dir):
    with Services(tmp_path_factory.mktemp("fuzz"), tiny_model_dir) as running:
        yield running


def modes_for(operation) -> tuple[GenerationMode, ...]:
    """Valid and invalid examples; only valid ones where the path is all there is to vary, because
    making a path segment invalid against its pattern costs hypothesis seconds per example, and a
    URL segment is a string whatever the schema says."""
    if operation.body or operation.query:
        return GenerationMode.POSITIVE, GenerationMode.NEGATIVE
    return (GenerationMode.POSITIVE,)


def fuzz(spec: dict, base_url: str, token_for, statuses: dict[tuple[str, int], int]) -> list[str]:
    """Every operation of the spec, positive and negative examples; the 5xx answers found.
    `statuses` counts the answers per (path, status)."""
    schema = schemathesis.openapi.from_dict(spec)
    server_errors: list[str] = []
    session = requests.Session()
    for result in schema.get_all_operations():
        operation = result.ok()
        headers = {"Authorization": f"Bearer {token_for(operation.path)}"}
        for mode in modes_for(operation):
            @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def call(case) -> None:
                response = case.call(base_url=base_url, session=session, headers=headers, timeout=REQUEST_TIMEOUT_S)
                key = (operation.path, response.status_code)
                statuses[key] = statuses.get(key, 0) + 1
                if response.status_code >= 500:
                    server_errors.append(f"{response.status_code} {operation.method.upper()} {operation.path} "
                                         f"({mode.value}): {case.as_curl_command(headers=headers)}\n"
                                         f"  -> {response.text[:300]}")
            try:
                call()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE, operation.path  # nothing in it can be made invalid
    return server_errors


def spec_of(base_url: str) -> dict:
    return httpx.get(f"{base_url}/openapi.json", timeout=10).json()


def test_router_spec_describes_completion_bodies_and_fuzzing_finds_no_server_error(services):
    spec = spec_of(services.router_url)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert {"model"} < set(body["required"]) and ("seed" in body["properties"] or path == "/v1/embeddings")
        # Steer valid examples to the model the site serves, so they get past the model check
        # into tokenization, placement and generation; invalid ones still try other names.
        body["properties"]["model"] = {"const": MODEL}
    # Calls and their results must pair up across messages (router.openai_request), which no JSON schema says:
    # valid chat examples hold no tool turns, so they get past the conversation check; invalid ones still do.
    chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    message = dict(chat["properties"]["messages"]["items"])
    message["properties"] = {**message["properties"], "role": {"enum": ["system", "developer", "user"]}}
    message["properties"].pop("tool_calls")
    message["properties"].pop("tool_call_id")
    chat["properties"]["messages"] = {**chat["properties"]["messages"], "items": message}
    statuses: dict[tuple[str, int], int] = {}
    errors = fuzz(spec, services.router_url, lambda _path: services.api_key, statuses)
    assert not errors, "\n".join(errors)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):  # got through, and was refused too
        assert statuses.get((path, 200)) and statuses.get((path, 400)), statuses


def test_registry_spec_fuzzing_finds_no_server_error(services):
    def token_for(path: str) -> str:
        if path.startswith("/v1/agent"):
            return services.site_token
        return ROUTER_TOKEN if path.startswith("/v1/router") else ADMIN_TOKEN

    statuses: dict[tuple[str, int], int] = {}
    errors = fuzz(spec_of(services.registry_url), services.registry_url, token_for, statuses)
    assert not errors, "\n".join(errors)
    answered = {status for _path, status in statuses}
    assert any(200 <= status < 300 for status in answered) and answered & {400, 422}, statuses
