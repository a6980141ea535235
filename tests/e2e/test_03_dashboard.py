"""The registry's dashboard in a real browser (headless Chromium) over the running cluster: sign in
with the admin token, see the three sites with their states and roles on the map and in the table,
hover one for its KV and heartbeat, see a placement arrive, cordon a site through the admin API and
see it change; the token never shows up in a URL or the registry's log. A screenshot is kept in the
test's tmp dir."""

from __future__ import annotations

import json

from tests.browser import Browser
from tests.e2e.conftest import BOTH, DECODE_ONLY, PREFILL_ONLY, complete, prompt_ids

SITE_STATUSES = ("JSON.stringify(Object.fromEntries([...document.querySelectorAll('#sites-table tbody tr')]"
                 ".map(row => [row.dataset.site, row.dataset.status])))")
MAP_MARKERS = ("JSON.stringify(Object.fromEntries([...document.querySelectorAll('#sites g.site')]"
               ".map(g => [g.dataset.site, [g.dataset.status, g.dataset.role]])))")


def wait_statuses(browser: Browser, expected: dict) -> None:
    browser.wait_for(f"{SITE_STATUSES} === {json.dumps(json.dumps(expected, separators=(',', ':')))}")


def hover(browser: Browser, selector: str) -> str:
    """Moves the mouse over the element (a real pointer event) and returns the tooltip's text."""
    x, y = browser.evaluate(f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
                            f".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; }})()")
    browser.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
    return browser.wait_for("!document.getElementById('tooltip').hidden && "
                            "document.getElementById('tooltip').textContent")


def test_the_dashboard_shows_the_fleet_live(cluster, http, tmp_path):
    token = cluster.config.admin_token
    with Browser.start(tmp_path) as browser:
        browser.open(f"{cluster.registry_url}/dashboard")
        assert browser.evaluate("!document.getElementById('login').hidden && document.getElementById('fleet').hidden")
        browser.evaluate(f"document.getElementById('token').value = {json.dumps(token)};"
                         "document.getElementById('login-form').requestSubmit()")
        everyone_active = {DECODE_ONLY: "active", PREFILL_ONLY: "active", BOTH: "active"}
        wait_statuses(browser, everyone_active)
        assert json.loads(browser.evaluate(MAP_MARKERS)) == {
            PREFILL_ONLY: ["active", "prefill"], DECODE_ONLY: ["active", "decode"], BOTH: ["active", "both"]}
        assert browser.wait_for("document.querySelectorAll('#countries path').length") > 150  # Natural Earth 110m
        tooltip = hover(browser, f"#sites g.site[data-site='{DECODE_ONLY}'] .mark")
        assert tooltip.startswith(DECODE_ONLY) and "KV free " in tooltip and "heartbeat " in tooltip

        # The router reports the pair it placed a request on; the dashboard lists it.
        placed = complete(http, cluster, prompt_ids(24, start=61), 2).sites
        rows = "[...document.querySelectorAll('#pairs-table tbody tr')].map(r => r.textContent)"
        browser.wait_for(f"{rows}.some(text => text.startsWith({json.dumps(placed[0])}))")
        # A split pair is drawn as an arc from its prefill site to its decode site (reported here as a
        # router would, since which pair the cost model picks for a request is not this test's business).
        with cluster.http_client(base_url=cluster.registry_url, timeout=10.0) as registry:
            registry.post("/v1/router/placements", headers={"Authorization": f"Bearer {cluster.config.router_token}"},
                          json={"placements": [{"prefill_site": PREFILL_ONLY, "decode_site": DECODE_ONLY,
                                                "num_requests": 3}]}).raise_for_status()
        browser.wait_for(f"!!document.querySelector('#arcs path[data-pair=\"{PREFILL_ONLY}>{DECODE_ONLY}\"]')")

        cluster.admin().cordon(DECODE_ONLY)
        try:
            wait_statuses(browser, {**everyone_active, DECODE_ONLY: "cordoned"})
            marker = f"document.querySelector('#sites g.site[data-site={json.dumps(DECODE_ONLY)}]').dataset.status"
            assert browser.evaluate(marker) == "cordoned"
            assert "state cordoned" in browser.evaluate("document.getElementById('tooltip').textContent")
            shot = browser.screenshot(tmp_path / "dashboard.png")
        finally:
            cluster.admin().uncordon(DECODE_ONLY)
        assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 10_000
        assert token not in browser.evaluate("location.href")
        assert browser.evaluate("sessionStorage.getItem('edgefire.adminToken')") == token
        browser.evaluate("document.getElementById('logout').click()")
        assert browser.evaluate("sessionStorage.getItem('edgefire.adminToken')") is None
    assert token not in cluster.processes["registry"].log_path.read_text(errors="replace")
