"""The dashboard's files as the registry serves them: the page and its assets without a token (the
data behind them needs the admin token), locked down by a Content-Security-Policy, and the map's
outlines from the packaged Natural Earth file."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def db_url(tmp_path, sqlite_template):  # the files do not depend on the database: SQLite only
    import shutil

    path = tmp_path / "registry.db"
    shutil.copy(sqlite_template, path)
    return f"sqlite:///{path}"


async def test_the_page_and_its_assets_are_served_locked_down(raw):
    page = await raw.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "form-action 'none'" in policy
    assert page.headers["referrer-policy"] == "no-referrer" and page.headers["cache-control"] == "no-store"
    assert 'src="/dashboard/dashboard.js"' in page.text and 'href="/dashboard/dashboard.css"' in page.text
    assert 'id="token" type="password"' in page.text and "name=" not in page.text.split('id="token"')[1].split(">")[0]
    script = await raw.get("/dashboard/dashboard.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert "sessionStorage" in script.text and "Authorization" in script.text
    assert (await raw.get("/dashboard/dashboard.css")).headers["content-type"].startswith("text/css")
    assert (await raw.get("/dashboard/../service.py")).status_code == 404
    missing = await raw.get("/dashboard/secrets.txt")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "no_such_file"
    assert "/dashboard" not in (await raw.get("/openapi.json")).json()["paths"]


async def test_the_map_outlines_are_natural_earth_countries(raw):
    response = await raw.get("/dashboard/countries-110m.json")
    assert response.status_code == 200 and "max-age" in response.headers["cache-control"]
    topology = response.json()
    countries = topology["objects"]["countries"]["geometries"]
    assert topology["type"] == "Topology" and len(countries) > 170
    assert {"Portugal", "Germany", "Poland", "Japan", "Brazil"} <= {c["properties"]["name"] for c in countries}


async def test_the_data_behind_the_page_needs_the_admin_token(raw):
    for path in ("/v1/admin/snapshot", "/v1/admin/placements"):
        assert (await raw.get(path)).status_code == 401
    assert json.loads((await raw.get("/v1/admin/placements", headers={"Authorization": "Bearer admin-secret"}))
                      .text) == {"window_s": 300.0, "pairs": []}
