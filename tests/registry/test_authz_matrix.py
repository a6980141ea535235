"""Who may call what on the registry: every route against every credential.

Each API belongs to one role (admin, router, site, metrics); any other known token gets 403, no
token or an unknown one 401 with `WWW-Authenticate: Bearer`, before anything else about the request
(a site's existence, the body) is looked at. Role tokens must differ, and what the admin API shows
of an API key leaves most of it secret.
"""

from __future__ import annotations

import re

import pytest
from fastapi.routing import APIRoute

from registry.auth import Authenticator
from registry.dashboard import router as dashboard_routes
from registry.records import ApiKeySpec
from registry.routes_admin import router as admin_routes
from registry.routes_agent import router as agent_routes
from registry.routes_router import router as router_routes
from registry.service import create_app

from .conftest import ADMIN_TOKEN, ROUTER_TOKEN, new_site

PUBLIC = {"/healthz", "/dashboard", "/dashboard/{name}", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
OWNER = {"/v1/admin/": "admin", "/v1/router/": "router", "/v1/agent/": "site", "/metrics": "admin"}


def owner_of(path: str) -> str:
    return next(role for prefix, role in OWNER.items() if path.startswith(prefix))


def guarded_calls(app) -> list[tuple[str, str, str]]:
    """(method, concrete path, owning role) for every route that needs a credential."""
    groups = (admin_routes, agent_routes, router_routes, dashboard_routes)
    included = [route for route in app.routes if not hasattr(route, "path")]
    assert len(included) == len(groups), "an API router this test does not know was added"
    calls = []
    for route in [r for group in groups for r in group.routes] + [r for r in app.routes if hasattr(r, "path")]:
        if route.path in PUBLIC:
            continue
        assert isinstance(route, APIRoute), f"{route.path} is served outside the API routers"
        path = re.sub(r"\{key_id\}", "999999", re.sub(r"\{name\}", "no-such-site", route.path))
        calls += [(method, path, owner_of(route.path)) for method in sorted(route.methods - {"HEAD"})]
    return calls


@pytest.fixture
async def tokens(admin, connect):
    """role -> token, with a second site's token and one revoked by rotation."""
    await new_site(admin, connect, "fra-1")
    await admin.create_site("ams-1", region="eu-west", country="NL", lat=52.4, lon=4.9)
    revoked = (await admin.issue_site_token("ams-1"))["token"]
    await admin.issue_site_token("ams-1", revoke_previous=True)
    return {"admin": ADMIN_TOKEN, "router": ROUTER_TOKEN, "site": (await admin.issue_site_token("fra-1"))["token"],
            "revoked_site": revoked, "unknown": "efs-" + "x" * 43}


async def test_every_route_answers_its_own_role_only(app, raw, tokens):
    calls = guarded_calls(app)
    assert len(calls) >= 25   # the admin, router and agent APIs and /metrics
    for method, path, owner in calls:
        for role, token in tokens.items():
            response = await raw.request(method, path, json={}, headers={"Authorization": f"Bearer {token}"})
            if role == owner:
                assert response.status_code not in (401, 403), (method, path, role, response.text)
            elif role in ("revoked_site", "unknown"):
                assert response.status_code == 401, (method, path, role, response.text)
                assert response.headers["www-authenticate"] == "Bearer"
                assert response.json()["error"]["code"] == "invalid_token"
            else:
                assert response.status_code == 403, (method, path, role, response.text)
                assert response.json()["error"]["code"] == "wrong_token_kind"
            assert token not in response.text


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Basic YWRtaW4=", ADMIN_TOKEN, f"Bearer\t{ADMIN_TOKEN}",
                                           f"Token {ADMIN_TOKEN}", f"Bearer {ADMIN_TOKEN}x"])
async def test_malformed_headers_are_401_before_the_site_or_body_is_looked_at(raw, tokens, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path in (("GET", "/v1/admin/sites/fra-1"), ("GET", "/v1/admin/sites/no-such-site"),
                         ("POST", "/v1/admin/sites"), ("POST", "/v1/agent/heartbeat"), ("GET", "/metrics")):
        response = await raw.request(method, path, content=b"{not json", headers=headers)
        assert response.status_code == 401, (authorization, path, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        assert ADMIN_TOKEN not in response.text


async def test_two_authorization_headers_are_401_on_every_route_whichever_holds_the_token(app, raw, tokens):
    """Which of two headers a hop in between added is not knowable, so neither is trusted (as the
    agents refuse two `authorization` entries); the heartbeat fast path reads its header itself."""
    calls = guarded_calls(app)
    assert ("POST", "/v1/agent/heartbeat", "site") in calls
    for method, path, owner in calls:
        right = f"Bearer {tokens[owner]}"
        for pair in ([right, right], [right, "Bearer wrong"], ["Bearer wrong", right]):
            response = await raw.request(method, path, json={}, headers=[("Authorization", value) for value in pair])
            assert response.status_code == 401, (method, path, pair, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
            error = response.json()["error"]
            assert error["code"] == "repeated_authorization" and "send one" in error["message"], (path, error)
            assert tokens[owner] not in response.text


async def test_the_scheme_is_case_insensitive_and_the_token_trimmed(raw, tokens):
    for authorization in (f"bearer {ADMIN_TOKEN}", f"BEARER {ADMIN_TOKEN}", f"Bearer   {ADMIN_TOKEN}"):
        assert (await raw.get("/v1/admin/sites", headers={"Authorization": authorization})).status_code == 200


async def test_a_token_in_the_query_string_or_a_cookie_is_not_a_credential(raw, tokens):
    for query in ("token", "access_token", "api_key"):
        assert (await raw.get(f"/v1/admin/sites?{query}={ADMIN_TOKEN}")).status_code == 401
    raw.cookies.set("token", ADMIN_TOKEN)
    assert (await raw.get("/v1/admin/sites")).status_code == 401


async def test_a_site_token_acts_only_for_its_own_site(raw, tokens, admin):
    site = {"Authorization": f"Bearer {tokens['site']}"}
    response = await raw.put("/v1/agent/registration", headers=site,
                             json={"name": "ams-1", "grpc_address": "10.0.0.9:1", "models": []})
    assert (response.status_code, response.json()["error"]["code"]) == (403, "wrong_site")
    assert (await admin.get_site("ams-1"))["grpc_address"] is None
    peers = await raw.get("/v1/agent/peers", headers=site)
    assert peers.status_code == 200 and "ams-1" not in peers.text


async def test_role_tokens_must_differ(db_url, store):
    with pytest.raises(ValueError, match="admin token and the router token must differ"):
        create_app(db_url, "one-token", "one-token", store=store)
    with pytest.raises(ValueError, match="router token and the metrics token must differ"):
        Authenticator(store.access, "admin-token", "router-token", metrics_token="router-token")
    with pytest.raises(ValueError, match="admin token and the metrics token must differ"):
        Authenticator(store.access, "admin-token", "router-token", metrics_token="admin-token")


async def test_the_admin_api_shows_at_most_a_quarter_of_an_imported_key(store, admin):
    short = "imported-key-16c"
    key, _secret = store.access.create_api_key(ApiKeySpec(name="imported"), "alice", secret=short)
    shown = (await admin.get_api_key(key.id))["key_prefix"]
    assert short.startswith(shown) and len(shown) <= len(short) // 4
    generated = await admin.create_api_key("generated")
    assert generated["key_prefix"] == generated["key"][:10]


def test_serve_with_one_token_for_two_roles_is_one_line_and_exit_2(tmp_path, caplog):
    """The router token sits in every router's config: given as the admin token too, it would carry
    admin rights everywhere. Refused before serving, with one line, not a traceback."""
    from deploy.cli import main as edgefire

    db = f"sqlite:///{tmp_path / 'registry.db'}"
    for tokens in (["--admin-token", "same-token", "--router-token", "same-token"],
                   ["--admin-token", "a-token", "--router-token", "r-token", "--metrics-token", "r-token"]):
        caplog.clear()
        assert edgefire(["registry", "serve", "--db", db, "--port", "1", *tokens]) == 2
        errors = [r for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and errors[0].exc_info is None and "must differ" in errors[0].getMessage()
