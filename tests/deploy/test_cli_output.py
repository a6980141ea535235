"""What the `edgefire` commands print when things around them go wrong: a reader that goes away
(`edgefire status | head`), and a state dir whose cluster.json is not what `edgefire up` wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.cli import EXIT_BROKEN_PIPE, main
from registry.client import SyncRegistryClient
from registry.migrate import upgrade_to_head
from registry.service import create_app
from tests.registry.conftest import ServerThread

ROOT = Path(__file__).resolve().parents[2]
EDGEFIRE = [sys.executable, "-m", "deploy.cli"]
ADMIN_TOKEN = "admin-test-token"


@pytest.fixture
def registry_url(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade_to_head(db_url)
    with ServerThread(create_app(db_url, ADMIN_TOKEN, "router-test-token")) as server:
        with SyncRegistryClient(server.url, ADMIN_TOKEN) as admin:
            for i in range(3):
                admin.create_site(f"site-{i}", region="eu-west", country="DE", lat=50.0, lon=8.0)
        yield server.url


@pytest.mark.parametrize("command", [["status"], ["usage"]])
def test_a_reader_that_goes_away_ends_the_command_quietly(registry_url, command):
    """`edgefire status | head`: once nobody reads, the command stops with the SIGPIPE status and no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)   # the reader is gone before the first byte is written
    try:
        done = subprocess.run(EDGEFIRE + [*command, "--registry-url", registry_url, "--admin-token", ADMIN_TOKEN],
                              cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, timeout=60)
    finally:
        os.close(write_end)
    assert done.returncode == EXIT_BROKEN_PIPE == 141, done.stderr.decode()
    assert done.stderr == b""


@pytest.mark.parametrize("content, said", [
    ({"registry_url": "http://127.0.0.1:1", "router_url": "http://127.0.0.1:2"}, "has no 'admin_token'"),
    ({"admin_token": "efa-x"}, "has no 'registry_url'"),
    ({"registry_url": 8500, "admin_token": "efa-x"}, "registry_url must be a string, got 8500"),
    ({"registry_urls": "http://127.0.0.1:1", "admin_token": "efa-x"}, "registry_urls must be a list of URLs"),
    (["http://127.0.0.1:1"], "must hold a JSON object"),
    ("{not json", "is not valid JSON"),
    (b"\xff\xfe{}", "is not valid JSON"),
])
@pytest.mark.parametrize("command", ["status", "usage"])
def test_a_damaged_cluster_json_is_named_with_what_is_wrong(tmp_path, capsys, content, said, command):
    path = tmp_path / "cluster.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    code = main([command, "--state-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: {path}") and said in err, err
    assert "--registry-url" in err or "--admin-token" in err


def test_an_unreadable_or_missing_cluster_json_is_named(tmp_path, capsys):
    (tmp_path / "cluster.json").mkdir()
    assert main(["status", "--state-dir", str(tmp_path)]) == 2
    assert f"error: cannot read {tmp_path / 'cluster.json'}: Is a directory" in capsys.readouterr().err
    assert main(["status", "--state-dir", str(tmp_path / "nothing")]) == 2
    assert "no running `edgefire up` cluster in" in capsys.readouterr().err


def test_flags_stand_in_for_what_cluster_json_lacks(registry_url, tmp_path, capsys):
    (tmp_path / "cluster.json").write_text(json.dumps({"registry_url": registry_url}))
    assert main(["status", "--state-dir", str(tmp_path), "--admin-token", ADMIN_TOKEN]) == 0
    assert "site-0" in capsys.readouterr().out
