"""Bad input and bad credentials: a clear 4xx with a JSON error body, and nothing written."""

from __future__ import annotations

import httpx
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
    ({"name": "fra-1", "country": "ß"}, 422, "invalid_field", "country"),  # upper-cases to 'SS'
    ({"name": "fra-1", "grpc_address": "nope"}, 422, "invalid_address", "grpc_address"),
    ({"name": "fra-1", "lat": "north"}, 422, "invalid_field", "lat"),
    ({"name": "fra-1", "colour": "red"}, 422, "invalid_field", "colour"),
    ({"region": "eu-west"}, 422, "invalid_field", "name"),
])
async def test_bad_site_fields(raw, body, status, code, field):
    error = assert_error(await raw.post("/v1/admin/sites", headers=ADMIN, json=body), status, code)
    assert field in error["message"]
    assert (await raw.get("/v1/admin/sites", headers=ADMIN)).json()["items"] == []


@pytest.mark.parametrize("field, value", [("requests_per_minute", 2**31), ("tokens_per_minute", 10**23)])
async def test_rate_limit_beyond_its_column_is_422_and_stores_nothing(raw, field, value):
    response = await raw.post("/v1/admin/api-keys", headers=ADMIN, json={"name": "team-a", field: value})
    error = assert_error(response, 422, "invalid_field")
    assert field in error["message"] and str(2**31 - 1) in error["message"]
    assert (await raw.get("/v1/admin/api-keys", headers=ADMIN)).json()["items"] == []


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


def _writes(app) -> list[tuple[str, str]]:
    """(method, path) of every POST/PUT/PATCH route, path parameters filled in."""
    return [(method.upper(), path.replace("{name}", "fra-1").replace("{key_id}", "1"))
            for path, operations in app.openapi()["paths"].items() for method in operations
            if method in ("post", "put", "patch")]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # no database is reached: one is enough
async def test_credential_is_checked_before_the_body(app, raw):
    """Issue 17, defect 9: an unauthenticated request learns nothing about body parsing (401, not
    400/422), and a token of the wrong kind is 403 whatever the body."""
    writes = _writes(app)
    assert len(writes) >= 11
    for method, path in writes:
        for body in (b"{nope", b"\xff\xfe"):
            response = await raw.request(method, path, content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == 401, (method, path, body, response.text)
            assert response.json()["error"]["code"] == "missing_token"
        wrong_kind = {"Authorization": "Bearer router-secret" if "/admin/" in path else "Bearer admin-secret",
                      "Content-Type": "application/json"}
        response = await raw.request(method, path, content=b"{nope", headers=wrong_kind)
        assert response.status_code in (401, 403), (method, path, response.text)


ROUTER = {"Authorization": "Bearer router-secret"}
BEYOND_INT64 = "99999999999999999999"
MALFORMED = [
    ("GET", "/v1/admin/audit-log?cursor=%C2%B2", None),  # '²': str.isdigit() says yes, int() says no
    ("GET", "/v1/admin/api-keys?cursor=%C2%B2", None),
    ("GET", f"/v1/admin/api-keys?cursor={BEYOND_INT64}", None),
    ("GET", f"/v1/admin/audit-log?cursor={BEYOND_INT64}", None),
    ("GET", f"/v1/admin/api-keys?limit={BEYOND_INT64}", None),
    ("GET", f"/v1/admin/api-keys/{BEYOND_INT64}", None),
    ("GET", f"/v1/admin/api-keys/-{BEYOND_INT64}", None),
    ("POST", f"/v1/admin/api-keys/{BEYOND_INT64}/revoke", None),
    ("GET", "/v1/admin/sites?cursor=a%00b", None),
    ("GET", "/v1/admin/sites/a%00b", None),
    ("POST", "/v1/admin/sites/a%00b/cordon", None),
    ("POST", "/v1/admin/api-keys", b'{"name": "\\ud800"}'),
    ("POST", "/v1/admin/api-keys", b'{"name": "a\\u0000b"}'),
    ("POST", "/v1/admin/sites", b'{"name": "\\udfff"}'),
    ("POST", "/v1/admin/sites", b'{"name": "fra-2", "\\ud800": 1}'),
    ("PUT", "/v1/admin/sites/fra-1/models", b'{"models": [{"model": "m\\ud800"}]}'),
    ("PATCH", "/v1/admin/sites/fra-1", b'{"models": [{"model": "m\\u0000"}]}'),
    ("POST", "/v1/router/api-keys/lookup", b'{"key": "\\ud800"}'),
    ("POST", "/v1/router/api-keys/lookup", b'{"key": "a\\u0000"}'),
]


async def test_malformed_ids_cursors_and_text_are_4xx_never_500(app):
    """Issue 17, defect 3 (registry): every malformed id, cursor or text answers a 4xx with the
    registry's error body; nothing reaches the database that it cannot hold."""
    raw = httpx.AsyncClient(transport=httpx.ASGITransport(app, raise_app_exceptions=False), base_url="http://registry")
    assert (await raw.post("/v1/admin/sites", headers=ADMIN, json={"name": "fra-1"})).status_code == 201
    for method, path, body in MALFORMED:
        headers = {**(ROUTER if path.startswith("/v1/router/") else ADMIN), "Content-Type": "application/json"}
        response = await raw.request(method, path, headers=headers, content=body)
        assert response.status_code in (400, 404, 422), (method, path, body, response.status_code, response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"] and error["code"], (path, error)
    assert [s["name"] for s in (await raw.get("/v1/admin/sites", headers=ADMIN)).json()["items"]] == ["fra-1"]
    assert (await raw.get("/v1/admin/api-keys", headers=ADMIN)).json()["items"] == []


NOT_CONVERTED = [  # (method, path, body, field, what the message says it must be, the value quoted back)
    ("POST", "/v1/admin/sites", {"name": "fra-2", "lat": True, "lon": 8.7}, "lat", "must be a number", "true"),
    ("POST", "/v1/admin/sites", {"name": "fra-2", "lat": "50.1", "lon": 8.7}, "lat", "must be a number", '"50.1"'),
    ("POST", "/v1/admin/sites", {"name": "fra-2", "heartbeat_interval_s": True}, "heartbeat_interval_s",
     "must be a number", "true"),
    ("POST", "/v1/admin/sites", {"name": "fra-2", "models": [{"model": "m", "kv_bytes_per_token": "12"}]},
     "models[0].kv_bytes_per_token", "must be an integer", '"12"'),
    ("POST", "/v1/admin/sites", {"name": "fra-2", "models": [{"model": "m", "kv_bytes_per_token": 12.0}]},
     "models[0].kv_bytes_per_token", "must be an integer (a JSON number without a decimal point: 5, not 5.0", "12.0"),
    ("PATCH", "/v1/admin/sites/fra-1", {"lat": False, "lon": 1}, "lat", "must be a number", "false"),
    ("PUT", "/v1/admin/sites/fra-1", {"heartbeat_interval_s": "2"}, "heartbeat_interval_s", "must be a number", '"2"'),
    ("POST", "/v1/admin/sites/fra-1/drain", {"deadline_s": True}, "deadline_s", "must be a number", "true"),
    ("POST", "/v1/admin/sites/fra-1/tokens", {"revoke_previous": "yes"}, "revoke_previous", "must be true or false",
     '"yes"'),
    ("POST", "/v1/admin/sites/fra-1/tokens", {"revoke_previous": 1}, "revoke_previous", "must be true or false", "1"),
    ("POST", "/v1/admin/api-keys", {"name": "k", "requests_per_minute": True}, "requests_per_minute",
     "must be an integer", "true"),
    ("POST", "/v1/admin/api-keys", {"name": "k", "requests_per_minute": 60.0}, "requests_per_minute",
     "must be an integer (a JSON number without a decimal point: 5, not 5.0", "60.0"),
]


@pytest.mark.parametrize("method, path, body, field, wanted, sent", NOT_CONVERTED)
async def test_admin_bodies_convert_no_types(raw, method, path, body, field, wanted, sent):
    """A boolean is never a number, a string never a number or a boolean, 12.0 never an integer:
    each is a 422 naming the field and the value, and nothing already stored changes."""
    await raw.post("/v1/admin/sites", headers=ADMIN, json={"name": "fra-1", "lat": 50.1, "lon": 8.7})
    before = (await raw.get("/v1/admin/audit-log", headers=ADMIN)).json()["items"]
    error = assert_error(await raw.request(method, path, headers=ADMIN, json=body), 422, "invalid_field")
    assert error["message"].startswith(f"{field}: {wanted}"), error["message"]
    assert error["message"].endswith(f"got {sent}"), error["message"]
    assert (await raw.get("/v1/admin/audit-log", headers=ADMIN)).json()["items"] == before
    site = (await raw.get("/v1/admin/sites/fra-1", headers=ADMIN)).json()
    assert (site["lat"], site["heartbeat_interval_s"], site["state"]) == (50.1, 2.0, "active")


async def test_numbers_are_still_numbers(raw):
    """Strict types refuse conversions, not numbers: an integer is a fine float."""
    response = await raw.post("/v1/admin/sites", headers=ADMIN, json={"name": "fra-1", "lat": 50, "lon": 8,
                                                                      "heartbeat_interval_s": 5})
    assert response.status_code == 201, response.text
    assert (response.json()["lat"], response.json()["heartbeat_interval_s"]) == (50.0, 5.0)


ADMIN_BODIES = [("POST", "/v1/admin/sites"), ("PUT", "/v1/admin/sites/fra-1"), ("PATCH", "/v1/admin/sites/fra-1"),
                ("POST", "/v1/admin/sites/fra-1/drain"), ("PUT", "/v1/admin/sites/fra-1/roles"),
                ("PUT", "/v1/admin/sites/fra-1/models"), ("POST", "/v1/admin/api-keys")]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # refused before any database is reached
@pytest.mark.parametrize("method, path", ADMIN_BODIES)
@pytest.mark.parametrize("content, message", [
    (b"", "request body: missing; send a JSON object"),
    (b"[]", "request body: must be a JSON object, got []"),
    (b"null", "request body: must be a JSON object, got null"),
    (b'"fra-1"', 'request body: must be a JSON object, got "fra-1"'),
])
async def test_an_empty_or_wrong_shaped_body_is_named(raw, method, path, content, message):
    response = await raw.request(method, path, content=content, headers={**ADMIN, "Content-Type": "application/json"})
    assert assert_error(response, 422, "invalid_field")["message"] == message


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("method, path, body, message", [
    ("POST", "/v1/admin/sites", {}, "name: required field is missing"),
    ("POST", "/v1/admin/sites/fra-1/drain", {}, "deadline_s: required field is missing"),
    ("PUT", "/v1/admin/sites/fra-1/models", {"models": [{"role": "decode"}]},
     "models[0].model: required field is missing"),
    ("POST", "/v1/admin/api-keys", {"name": "k", "regions": []}, "regions: is not a field of this request"),
])
async def test_a_missing_or_unknown_field_is_named(raw, method, path, body, message):
    error = assert_error(await raw.request(method, path, headers=ADMIN, json=body), 422, "invalid_field")
    assert error["message"].startswith(message), error["message"]
