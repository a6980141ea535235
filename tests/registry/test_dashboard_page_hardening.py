"""The dashboard page itself in headless Chromium against a real registry server: what the state column
and tooltip say agrees with the colour, and signing out stops the refresh loop even when a refresh
was in flight at that moment."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from registry.client import SyncRegistryClient
from tests.browser import Browser
from tests.registry.conftest import ADMIN_TOKEN

ROWS = ("JSON.stringify([...document.querySelectorAll('#sites-table tbody tr')]"
        ".map(row => [row.dataset.site, row.dataset.status, row.querySelector('td.status').textContent]))")


@pytest.fixture
def db_url(tmp_path, sqlite_template):  # the page does not depend on the database: SQLite only
    path = tmp_path / "registry.db"
    shutil.copy(sqlite_template, path)
    return f"sqlite:///{path}"


def add_site(url: str, name: str, draining: bool) -> None:
    with SyncRegistryClient(url, ADMIN_TOKEN) as admin:
        admin.create_site(name, region="eu-west", country="DE", lat=50.1, lon=8.7)
        token = admin.issue_site_token(name)["token"]
    with SyncRegistryClient(url, token) as agent:
        agent.heartbeat({"kv_blocks_total": 8, "kv_blocks_free": 8, "block_size": 16, "draining": draining})


def signed_in(browser: Browser, url: str) -> None:
    browser.open(f"{url}/dashboard")
    browser.evaluate(f"document.getElementById('token').value = {json.dumps(ADMIN_TOKEN)};"
                     "document.getElementById('login-form').requestSubmit()")
    browser.wait_for("document.querySelectorAll('#sites-table tbody tr').length > 0")


def test_a_site_draining_itself_reads_draining_not_active(live_server, tmp_path):
    # An agent stopping (SIGTERM) drains while the registry still holds it active: the dot is the
    # draining colour, and the words beside it must not say plain "active".
    add_site(live_server, "fra-1", draining=True)
    add_site(live_server, "ams-1", draining=False)
    with Browser.start(tmp_path) as browser:
        signed_in(browser, live_server)
        rows = json.loads(browser.wait_for(f"document.querySelectorAll('#sites-table tbody tr').length === 2 && {ROWS}"))
        assert rows == [["ams-1", "active", "active"], ["fra-1", "draining", "active, draining"]]
        tooltip = browser.evaluate("document.querySelector('#sites g.site[data-site=\"fra-1\"] title').textContent")
        assert "state active, draining" in tooltip


def test_signing_out_during_a_refresh_stops_the_loop(live_server, tmp_path):
    add_site(live_server, "fra-1", draining=False)
    with Browser.start(tmp_path) as browser:
        signed_in(browser, live_server)
        # Hold every admin call for a while and count the calls made, so the sign-out lands mid-refresh.
        browser.evaluate("""(() => {
            const real = window.fetch;
            window.adminCalls = 0; window.inFlight = 0;
            window.fetch = async (...args) => {
                window.adminCalls += 1; window.inFlight += 1;
                await new Promise((done) => setTimeout(done, 400));
                try { return await real(...args); } finally { window.inFlight -= 1; }
            };
            const interval = document.getElementById('interval');
            interval.value = '1000'; interval.dispatchEvent(new Event('change'));
        })()""")
        browser.wait_for("window.inFlight > 0")
        browser.evaluate("document.getElementById('logout').click()")
        calls_at_sign_out = browser.evaluate("window.adminCalls")
        time.sleep(2.0)  # past the in-flight refresh and the 1 s interval after it
        assert browser.evaluate("window.adminCalls") == calls_at_sign_out
        assert browser.evaluate("document.getElementById('login-error').textContent") == ""
        assert browser.evaluate("!document.getElementById('login').hidden")
