"""Headless Chromium for tests, driven over its DevTools protocol (a websocket; no extra packages).

    with Browser.start(tmp_path) as browser:        # pytest.skip when Debian's chromium is missing
        browser.open("http://127.0.0.1:8500/dashboard")
        browser.evaluate("document.title")
        browser.wait_for("document.querySelectorAll('tr').length > 2")
        browser.screenshot(tmp_path / "page.png")

Chromium starts with a fresh profile and without its background networking (this network refuses
outside connections, and waiting on them slows it down); it never downloads anything.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

CANDIDATES = ("chromium", "chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
         "--disable-default-apps", "--remote-debugging-port=0", "--window-size=1400,900"]
START_TIMEOUT_S = 30.0


class BrowserError(RuntimeError):
    pass


def chromium_path() -> str:
    found = next((path for path in map(shutil.which, CANDIDATES) if path), None)
    if found is None:
        pytest.skip("Debian's `chromium` is not installed (.ci/run installs it with apt-get when it can); "
                    "the dashboard's browser test needs it")
    return found


class Browser:
    def __init__(self, process: subprocess.Popen, websocket, stack: contextlib.ExitStack) -> None:
        self._process = process
        self._ws = websocket
        self._stack = stack
        self._ids = itertools.count(1)

    @classmethod
    def start(cls, tmp_path: Path) -> Browser:
        profile = tmp_path / "chromium-profile"
        profile.mkdir()
        process = subprocess.Popen([chromium_path(), *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                   stdout=subprocess.DEVNULL, stderr=(tmp_path / "chromium.log").open("wb"))
        stack = contextlib.ExitStack()
        try:
            port = cls._devtools_port(process, profile)
            pages = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10, trust_env=False).json()
            page = next(p for p in pages if p["type"] == "page")
            websocket = stack.enter_context(connect(page["webSocketDebuggerUrl"], max_size=64 << 20, open_timeout=10,
                                                    proxy=None))
        except BaseException:
            stack.close()
            process.kill()
            process.wait()
            raise
        browser = cls(process, websocket, stack)
        browser.call("Page.enable")
        browser.call("Runtime.enable")
        return browser

    @staticmethod
    def _devtools_port(process: subprocess.Popen, profile: Path) -> int:
        """Chromium writes the port it chose into DevToolsActivePort once it listens."""
        deadline = time.monotonic() + START_TIMEOUT_S
        marker = profile / "DevToolsActivePort"
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise BrowserError(f"chromium exited with {process.returncode} at start")
            if marker.is_file() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            time.sleep(0.05)
        raise BrowserError(f"chromium did not open its DevTools port within {START_TIMEOUT_S:.0f} s")

    def call(self, method: str, timeout_s: float = 30.0, **params) -> dict:
        """One DevTools command; its result (events that arrive meanwhile are dropped)."""
        message_id = next(self._ids)
        self._ws.send(json.dumps({"id": message_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            message = json.loads(self._ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if message.get("id") == message_id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message.get("result", {})

    def open(self, url: str) -> None:
        result = self.call("Page.navigate", url=url)
        if result.get("errorText"):
            raise BrowserError(f"{url}: {result['errorText']}")
        self.wait_for("document.readyState === 'complete'")

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (promises are awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} threw: {result['exceptionDetails'].get('exception', {})}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 20.0):
        """Polls until the expression is truthy; returns its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"timed out waiting for {expression!r} (last value {value!r})")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        try:
            self._stack.close()
        finally:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
