"""Bad input and bad credentials: a clear 4xx with a JSON error body, and nothing written."""

from __future__ import annotations

import pytest

ADMIN = {"Authorization": "Bearer admin-secret"}


def assert_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]
    return error


@pytest.mark.parametrize("headers, code", [
    ({}, "missing_token"),
    ({"Authorization": "Basic abc"}, "missing_token"),
    ({"Authorization": "Bearer "}, "missing_token"),
    ({"Authorization": "Bearer wrong"}, "invalid_token"),
])
@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/admin/sites"), ("GET", "/v1/router/snapshot"), ("POST", "/v1/agent/heartbeat"),
    ("POST", "/v1/router/api-keys/lookup"), ("DELETE", "/v1/agent/registration"),
])
async def test_missing_or_wrong_token_is_401(raw, headers, code, method, path):
    response = await raw.request(method, path, headers=headers, json={})
    assert_error(response, 401, code)
    assert response.headers["www-authenticate"] == "Bearer"


async def test_admin_token_cannot_act_as_an_agent_or_router(raw):
    assert_error(await raw.post("/v1/agent/heartbeat", headers=ADMIN, json={}), 403, "wrong_token_kind")
    assert_error(await raw.get("/v1/router/snapshot", headers=ADMIN), 403, "wrong_token_kind")


@pytest.mark.parametrize("body, status, code, field", [
    ({"name": "fra-1", "lat": 91, "lon": 0}, 422, "invalid_coordinates", "lat"),
    ({"name": "fra-1", "lat": 1}, 422, "invalid_coordinates", "lat and lon"),
    ({"name": "FRA_1"}, 422, "invalid_site_name", "site name"),
    ({"name": "fra-1", "country": "Germany"}, 422, "invalid_field", "country"),
    ({"name": "fra-1", "grpc_address": "nope"}, 422, "invalid_address", "grpc_address"),
    ({"name": "fra-1", "lat": "north"}, 422, "invalid_field", "lat"),
    ({"name": "fra-1", "colour": "red"}, 422, "invalid_field", "colour"),
    ({"region": "eu-west"}, 422, "invalid_field", "name"),
])
async def test_bad_site_fields(raw, body, status, code, field):
    error = assert_error(await raw.post("/v1/admin/sites", headers=ADMIN, json=body), status, code)
    assert field in error["message"]
    assert (await raw.get("/v1/admin/sites", headers=ADMIN)).json()["items"] == []


async def test_duplicate_site_is_409(raw):
    assert (await raw.post("/v1/admin/sites", headers=ADMIN, json={"name": "fra-1"})).status_code == 201
    assert_error(await raw.post("/v1/admin/sites", headers=ADMIN, json={"name": "fra-1"}), 409, "duplicate_site")


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/v1/admin/sites/nowhere", None), ("PATCH", "/v1/admin/sites/nowhere", {"region": "x"}),
    ("DELETE", "/v1/admin/sites/nowhere", None), ("POST", "/v1/admin/sites/nowhere/cordon", None),
    ("POST", "/v1/admin/sites/nowhere/drain", {"deadline_s": 5}), ("PUT", "/v1/admin/sites/nowhere/models", {"models": []}),
    ("POST", "/v1/admin/sites/nowhere/tokens", {}), ("POST", "/v1/admin/api-keys/42/revoke", None),
])
async def test_unknown_things_are_404(raw, method, path, body):
    response = await raw.request(method, path, headers=ADMIN, json=body)
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


async def test_malformed_json_is_400(raw):
    response = await raw.post("/v1/admin/sites", headers={**ADMIN, "Content-Type": "application/json"}, content=b"{nope")
    assert_error(response, 400, "invalid_json")


async def test_oversize_body_is_413_declared_or_streamed(raw):
    big = b'{"name": "' + b"a" * (70 * 1024) + b'"}'
    response = await raw.post("/v1/admin/sites", headers={**ADMIN, "Content-Type": "application/json"}, content=big)
    assert_error(response, 413, "body_too_large")

    async def chunks():
        for start in range(0, len(big), 8192):
            yield big[start:start + 8192]

    streamed = await raw.post("/v1/admin/sites", headers={**ADMIN, "Content-Type": "application/json"}, content=chunks())
    assert_error(streamed, 413, "body_too_large")
    assert (await raw.get("/v1/admin/sites", headers=ADMIN)).json()["items"] == []


async def test_bad_paging_and_actor(raw):
    assert_error(await raw.get("/v1/admin/sites?limit=0", headers=ADMIN), 422, "invalid_field")
    assert_error(await raw.get("/v1/admin/audit-log?cursor=abc", headers=ADMIN), 422, "invalid_cursor")
    assert_error(await raw.get("/v1/admin/sites", headers={**ADMIN, "X-Edgefire-Actor": "a b"}), 400, "invalid_actor")


async def test_unknown_endpoint_is_json_404(raw):
    assert_error(await raw.get("/v1/nothing-here", headers=ADMIN), 404, "no_such_endpoint")


async def test_heartbeat_body_errors_match_the_rest_of_the_api(raw):
    """Heartbeats are served in front of FastAPI; their 413 / 400 / 422 bodies are the API's own."""
    await raw.post("/v1/admin/sites", headers=ADMIN, json={"name": "fra-1"})
    token = (await raw.post("/v1/admin/sites/fra-1/tokens", headers=ADMIN, json={})).json()["token"]
    agent = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    big = b'{"kv_blocks_total": 1, "x": "' + b"a" * (70 * 1024) + b'"}'
    assert_error(await raw.post("/v1/agent/heartbeat", headers=agent, content=big), 413, "body_too_large")

    async def chunks():
        for start in range(0, len(big), 8192):
            yield big[start:start + 8192]

    assert_error(await raw.post("/v1/agent/heartbeat", headers=agent, content=chunks()), 413, "body_too_large")
    assert_error(await raw.post("/v1/agent/heartbeat", headers=agent, content=b"{nope"), 400, "invalid_json")
    error = assert_error(await raw.post("/v1/agent/heartbeat", headers=agent, json={"kv_blocks_free": 1}), 422,
                         "invalid_field")
    assert "kv_blocks_total" in error["message"]
    ok = await raw.post("/v1/agent/heartbeat", headers=agent, json={"kv_blocks_total": 2, "kv_blocks_free": 1,
                                                                     "block_size": 16})
    assert (ok.status_code, ok.headers["content-type"], ok.json()) == (200, "application/json",
                                                                        {"state": "active", "drain_deadline": None, "active_role": None})
