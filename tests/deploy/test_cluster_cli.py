"""`edgefire up` and `edgefire status` as a user runs them, and the launcher's config handling."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from deploy.cluster import ENTER, ERASE_LINE, HOME, LEAVE, links_matrix, status_table, usage_table
from deploy.cluster_config import ClusterConfigError, demo_sites, load_cluster_toml
from deploy.launcher import to_toml
from deploy.processes import free_port, is_ours
from node_agent.config import load_config

ROOT = Path(__file__).resolve().parents[2]
# Ctrl-C reaches these commands as from a terminal: a test run started in the background by a shell
# (`./.ci/run &`) hands its children SIGINT ignored, which Python then leaves ignored.
EDGEFIRE = [sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                                  "from deploy.cli import main; sys.exit(main())"]


def test_demo_sites_mix_roles_in_real_cities():
    sites = demo_sites(3)
    assert [(s.name, s.role) for s in sites] == [("lisbon", "prefill"), ("frankfurt", "decode"), ("warsaw", "both")]
    assert all(-90 <= s.lat <= 90 and -180 <= s.lon <= 180 for s in sites)
    assert {s.role for s in demo_sites(2)} == {"both"}  # two sites must each survive the other's loss
    assert len({s.name for s in demo_sites(12)}) == 12
    with pytest.raises(ClusterConfigError):
        demo_sites(0)


@pytest.mark.parametrize("text, message", [
    ('[[sites]]\nname = "a"\nregion = "r"\ncountry = "PT"\nlat = 1.0\nlon = 2.0\nrole = "prefill"\n', "decode"),
    ('colour = "blue"\n', "unknown cluster setting"),
    ('[agent]\nsite_token = "x"\n', "set by the launcher"),
    ('[agent]\nkv_cache_gb = 3\n', "unknown setting"),
    ('[router]\nport = 1\n', "set by the launcher"),
    ('[[sites]]\nname = "a"\ncity = "Lisbon"\n', r"sites\[0\]: city: unknown setting"),
    ('[[sites]]\nname = "a"\nregion = "r"\ncountry = "PT"\nlat = 1.0\n', r"sites\[0\]: missing required setting\(s\): lon"),
    ('[router]\nmax_attempts = "3"\n', "router: max_attempts: must be int, got str '3'"),
    ('[agent]\nmax_num_seqs = 1.5\n', "agent: max_num_seqs: must be int, got float 1.5"),
    ('sites = 3  # not [[sites]] tables\n', "sites: must be a list of table, got int 3"),
    ('[[sites]]\nname = "a"\nregion = "r"\ncountry = "PT"\nlat = 1.0\nlon = 2.0\ncpus = [4096]\n',
     r"sites.a.cpus: CPU\(s\) \[4096\] are not available"),
    ('[[sites]]\nname = "a"\nregion = "r"\ncountry = "PT"\nlat = 1.0\nlon = 2.0\ncpus = [-1]\n',
     r"sites.a.cpus: must be a list of CPU numbers"),
    # The registry's rules for a site, checked before anything starts (they were a traceback from the seeding).
    ('[[sites]]\nname = "Lisbon"\nregion = "r"\ncountry = "PT"\nlat = 1.0\nlon = 2.0\n',
     r"sites.Lisbon: site name 'Lisbon' must be 1-63 characters"),
    ('[[sites]]\nname = "a"\nregion = "r"\ncountry = "PT"\nlat = 200.0\nlon = 2.0\n',
     r"sites.a: lat must be between -90 and 90, got 200.0"),
    ('[[sites]]\nname = "a"\nregion = "EU West"\ncountry = "PT"\nlat = 1.0\nlon = 2.0\n', r"sites.a: region 'EU West'"),
    ('[[sites]]\nname = "a"\nregion = "r"\ncountry = "Portugal"\nlat = 1.0\nlon = 2.0\n',
     r"sites.a: country 'Portugal'"),
    # Ports: in range and each used once (two agents on one gRPC port both started and shared it).
    ('router_port = 70000\n', r"router_port: must be a port in 1-65535 \(0: a free one\), got 70000"),
    ('router_port = 65535\nrouters = 2\n', r"router_port \+ 1 \(router 2\): must be a port in 1-65535"),
    ('router_port = 8500\nregistry_port = 8500\n', "router_port and registry_port: both use port 8500"),
    ('[[sites]]\nname = "a"\nregion = "r"\ncountry = "PT"\nlat = 1.0\nlon = 2.0\ngrpc_port = 50071\n'
     '[[sites]]\nname = "b"\nregion = "r"\ncountry = "PT"\nlat = 1.0\nlon = 2.0\ngrpc_port = 50071\n',
     "sites.a.grpc_port and sites.b.grpc_port: both use port 50071"),
    ('[[sites]]\nname = "a"\nregion = "r"\ncountry = "PT"\nlat = 1.0\nlon = 2.0\ngrpc_port = -1\n',
     "sites.a.grpc_port: must be a port in 1-65535"),
    ('[agent]\nkv_data_port = 7000\n[[sites]]\nname = "a"\nregion = "r"\ncountry = "PT"\nlat = 1.0\nlon = 2.0\n'
     '[[sites]]\nname = "b"\nregion = "r"\ncountry = "PT"\nlat = 1.0\nlon = 2.0\n',
     r"agent.kv_data_port \(site a\) and agent.kv_data_port \(site b\): both use port 7000"),
])
def test_bad_cluster_files_say_what_to_change(tmp_path, text, message):
    path = tmp_path / "cluster.toml"
    path.write_text(text if "[[sites]]" in text else text + '[[sites]]\nname = "a"\nregion = "r"\ncountry = "PT"\n'
                    'lat = 1.0\nlon = 2.0\n')
    with pytest.raises(ClusterConfigError, match=message):
        load_cluster_toml(path)


def test_generated_agent_toml_loads_as_the_agent_config(tmp_path, tiny_model_dir):
    settings = {"site": "lisbon", "lat": 38.72, "lon": -9.14, "role": "prefill", "kv_cache_bytes": 1 << 20,
                "heartbeat_interval_s": 1, "peer_token": 'quote"d', "registry_url": None,
                "models": {"tiny-1.0": str(tiny_model_dir)}}
    path = tmp_path / "agent.toml"
    path.write_text(to_toml(settings))
    config = load_config(path, environ={})
    assert (config.site, config.role, config.lat, config.peer_token) == ("lisbon", "prefill", 38.72, 'quote"d')
    assert config.models == {"tiny-1.0": str(tiny_model_dir)} and config.registry_url is None


def test_status_table_shows_state_role_devices_load_kv_and_heartbeat_age():
    sites = [{"name": "lisbon", "state": "cordoned", "alive": True, "region": "eu-west", "grpc_address": "h:1",
              "models": [{"model": "m", "role": "prefill"}], "heartbeat_age_s": 0.42,
              "capacity": {"kv_blocks_free": 30, "kv_blocks_total": 40, "num_running": 2, "num_waiting": 1,
                           "num_gpus": 4, "tensor_parallel_size": 2, "pipeline_parallel_size": 2}},
             {"name": "warsaw", "state": "active", "alive": False, "region": None, "grpc_address": None,
              "models": [{"model": "m", "role": "both"}], "heartbeat_age_s": None, "capacity": None},
             {"name": "oslo", "state": "active", "alive": True, "region": "eu-north", "grpc_address": "h:2",
              "models": [{"model": "m", "role": "both"}], "heartbeat_age_s": 1.0,
              "capacity": {"kv_blocks_free": 1, "kv_blocks_total": 2}},  # an agent older than the layout fields
             {"name": "sofia", "state": "active", "alive": True, "region": "eu-east", "grpc_address": "h:3",
              "models": [{"model": "m", "role": "both"}], "heartbeat_age_s": 1.0,
              "capacity": {"kv_blocks_free": 1, "kv_blocks_total": 2, "num_gpus": 4, "tensor_parallel_size": 2,
                           "pipeline_parallel_size": 2, "expert_parallel_size": 2}}]
    lines = status_table(sites).splitlines()
    assert lines[0].split()[:4] == ["site", "state", "alive", "role"]
    assert lines[2].split() == ["lisbon", "cordoned", "yes", "prefill", "eu-west", "4", "(2x2)", "2/1", "30/40",
                                "(75%)", "0.4s", "ago", "h:1"]
    assert lines[3].split()[:4] == ["warsaw", "active", "no", "both"] and "never" in lines[3]
    assert lines[4].split()[5:7] == ["cpu", "(1x1)"]
    assert lines[5].split()[5:7] == ["4", "(2x2,ep2)"]


def test_status_table_shows_the_planners_active_role():
    site = {"name": "warsaw", "state": "active", "alive": True, "region": "eu", "grpc_address": "h:1",
            "models": [{"model": "m", "role": "both"}], "active_role": "prefill", "heartbeat_age_s": 1.0,
            "capacity": None}
    assert "both (now prefill)" in status_table([site]).splitlines()[2]


def test_status_table_role_is_the_models_roles_within_the_sites_allowed_roles():
    # an operator narrowed warsaw to decode (PUT .../roles): routers no longer prefill there
    site = {"name": "warsaw", "state": "active", "alive": True, "region": "eu", "grpc_address": "h:1",
            "roles": ["decode"], "models": [{"model": "m", "role": "both"}], "heartbeat_age_s": 1.0,
            "capacity": None}
    two_models = {**site, "name": "oslo", "roles": ["prefill", "decode"],
                  "models": [{"model": "m", "role": "prefill"}, {"model": "n", "role": "decode"}]}
    unserved = {**site, "name": "sofia", "roles": ["prefill"], "models": [{"model": "m", "role": "decode"}]}
    lines = status_table([site, two_models, unserved]).splitlines()
    assert [line.split()[3] for line in lines[2:]] == ["decode", "both", "none"]


def test_usage_table_shows_periods_keys_models_and_totals():
    answer = {"granularity": "hour", "items": [
        {"key_id": 3, "key_name": "team-a", "model": "tiny", "period_start": 1795449600, "requests": 2,
         "prompt_tokens": 40, "cached_prompt_tokens": 16, "completion_tokens": 8, "total_tokens": 48}],
        "totals": {"requests": 2, "prompt_tokens": 40, "cached_prompt_tokens": 16, "completion_tokens": 8,
                   "total_tokens": 48}}
    lines = usage_table(answer).splitlines()
    assert lines[0].split() == ["period", "(UTC)", "key", "model", "requests", "prompt", "tokens", "cached",
                                "completion", "tokens", "total"]
    assert lines[2].split() == ["2026-11-23", "16:00", "3", "team-a", "tiny", "2", "40", "16", "8", "48"]
    assert lines[3].split() == ["total", "2", "40", "16", "8", "48"]


def test_links_matrix_shows_rtt_throughput_and_age_per_measured_pair():
    # lisbon measured 850 Mbps pulling KV from warsaw: the bytes went warsaw -> lisbon
    links = [{"src": "lisbon", "dst": "warsaw", "rtt_ms": 41.23, "bandwidth_mbps": 850.0, "measured_at": 990.0},
             {"src": "warsaw", "dst": "lisbon", "rtt_ms": 40.0, "bandwidth_mbps": 2500.0, "measured_at": 400.0}]
    lines = links_matrix(["lisbon", "madrid", "warsaw"], links, now=1000.0).splitlines()
    assert lines[0].split() == ["to", "\\", "from", "lisbon", "madrid", "warsaw"]
    assert "column's site to row's site" in lines[-1]
    assert lines[2].split() == ["lisbon", "·", "-", "41.2ms", "850Mbps", "10s", "ago"]
    assert lines[3].split() == ["madrid", "-", "·", "-"]
    assert lines[4].split() == ["warsaw", "40.0ms", "2.5Gbps", "10min", "ago", "-", "·"]


def start_up(state_dir: Path, model_dir: Path, port: int, registry_port: int, log: Path) -> subprocess.Popen:
    argv = EDGEFIRE + ["up", "--model", str(model_dir), "--model-name", "tiny", "--sites", "1", "--port", str(port),
                       "--registry-port", str(registry_port), "--state-dir", str(state_dir),
                       "--api-key", "ef-test-key-0123456789", "--admin-token", "admin-test-token"]
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)


def wait_up(process: subprocess.Popen, log: Path, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while "Ctrl-C stops everything" not in log.read_text():
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    return log.read_text()


def chat(port: int) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                      headers={"Authorization": "Bearer ef-test-key-0123456789"},
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


def child_pids(state_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in (state_dir / "run").glob("*.pid")]


def check_status_watch(state_dir: Path) -> None:
    """`edgefire status --watch` redraws the table in place (ANSI: alternate screen, home, erase) until
    Ctrl-C, which leaves the terminal as it was and exits 0."""
    watch = subprocess.Popen(EDGEFIRE + ["status", "--watch", "--interval", "0.2", "--state-dir", str(state_dir)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    output = bytearray()

    def pump() -> None:
        while chunk := watch.stdout.read1(4096):
            output.extend(chunk)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while output.count(HOME.encode()) < 3:
            if watch.poll() is not None or time.monotonic() > deadline:
                watch.kill()
                pytest.fail(f"status --watch drew {output.count(HOME.encode())} frame(s): {bytes(output)[-400:]!r} "
                            f"{watch.stderr.read()[-400:]!r}")
            time.sleep(0.05)
        watch.send_signal(signal.SIGINT)
        assert watch.wait(10) == 0
    finally:
        if watch.poll() is None:
            watch.kill()
    reader.join(5)
    text = output.decode()
    assert text.startswith(ENTER) and text.endswith(LEAVE)
    frames = text.removeprefix(ENTER).split(HOME)[1:]
    assert len(frames) >= 3
    for frame in frames[:3]:
        lines = [line.removesuffix(ERASE_LINE) for line in frame.split("\n")]
        assert lines[0].startswith("edgefire status") and "every 0.2s" in lines[0]
        assert any(line.startswith("lisbon ") and " yes " in line for line in lines)


def test_up_after_a_crashed_up_starts_cleanly_and_ctrl_c_stops_everything(tmp_path, tiny_model_dir):
    state_dir, port, registry_port = tmp_path / "state", free_port(), free_port()
    first = start_up(state_dir, tiny_model_dir, port, registry_port, tmp_path / "first.log")
    try:
        banner = wait_up(first, tmp_path / "first.log")
        assert "ef-test-key-0123456789" in banner and f"http://127.0.0.1:{port}" in banner
        assert "from openai import OpenAI" in banner and "curl" in banner
        assert chat(port).status_code == 200
        stale = child_pids(state_dir)
        assert len(stale) == 3  # registry, one agent, router
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the launcher crashes; its children live on, holding the ports
        first.wait()
    assert all(is_ours(pid) for pid in stale)
    secret_files = [state_dir / "cluster.json", *(state_dir / "config").glob("*.toml")]
    assert len(secret_files) == 3  # cluster.json, the agent's and the router's configs
    for path in secret_files:
        assert path.stat().st_mode & 0o777 == 0o600, path
        path.chmod(0o644)  # as an older launcher or a careless copy left them: rewriting must close them again

    second = start_up(state_dir, tiny_model_dir, port, registry_port, tmp_path / "second.log")
    try:
        wait_up(second, tmp_path / "second.log")
        assert "stopped processes left by an earlier launcher" in (tmp_path / "second.log").read_text()
        assert not any(is_ours(pid) for pid in stale)
        response = chat(port)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] > 0
        seen = response.json()["usage"]
        deadline = time.monotonic() + 30
        while True:   # the router reports what it served within about a second
            usage = subprocess.run(EDGEFIRE + ["usage", "--state-dir", str(state_dir), "--granularity", "total",
                                               "--json"], cwd=ROOT, capture_output=True, text=True, timeout=30)
            assert usage.returncode == 0, usage.stderr
            totals = json.loads(usage.stdout)["totals"]
            if totals["requests"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert (totals["requests"], totals["prompt_tokens"], totals["completion_tokens"]) == (
            1, seen["prompt_tokens"], seen["completion_tokens"])
        status = subprocess.run(EDGEFIRE + ["status", "--state-dir", str(state_dir)], cwd=ROOT, capture_output=True,
                                text=True, timeout=30)
        assert status.returncode == 0, status.stderr
        assert "lisbon" in status.stdout and "yes" in status.stdout
        check_status_watch(state_dir)
        saved = json.loads((state_dir / "cluster.json").read_text())
        assert saved["admin_token"] == "admin-test-token"
        assert all(path.stat().st_mode & 0o777 == 0o600 for path in secret_files)
        logs = {path.name: path.read_text() for path in (state_dir / "logs").glob("*.log")}
        assert logs and not [name for name, text in logs.items() if "HTTP Request:" in text]  # no line per heartbeat
        children = child_pids(state_dir)
        second.send_signal(signal.SIGINT)
        assert second.wait(60) == 0
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    assert "stopped." in (tmp_path / "second.log").read_text()
    assert not any(is_ours(pid) for pid in children)
    assert not list((state_dir / "run").glob("*.pid"))


def test_a_second_interrupt_while_stopping_kills_everything_at_once(tmp_path, tiny_model_dir):
    """Ctrl-C, then SIGTERM while the sites drain (as `timeout`, systemd or docker repeat it): the launcher
    stops waiting, but no process of the cluster is left running and no pid file is left behind."""
    state_dir, port, registry_port = tmp_path / "state", free_port(), free_port()
    log = tmp_path / "up.log"
    up = start_up(state_dir, tiny_model_dir, port, registry_port, log)
    try:
        wait_up(up, log)
        children = child_pids(state_dir)
        assert len(children) == 3
        up.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while "stopping:" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
    text = log.read_text()
    assert "interrupted again: killing what is still running" in text and text.rstrip().endswith("stopped."), text
    assert not any(is_ours(pid) for pid in children)
    assert not list((state_dir / "run").glob("*.pid"))


def test_status_watch_keeps_the_last_table_while_the_registry_is_away(monkeypatch, capsys):
    """A redraw that cannot reach the registry says so above the last table it had, and tries again."""
    import argparse

    from deploy import cluster
    from registry.client import RegistryError

    site = {"name": "lisbon", "state": "active", "alive": True, "roles": ["prefill"], "models": [], "region": "eu-west",
            "capacity": {"kv_blocks_free": 10, "kv_blocks_total": 20, "num_running": 1, "num_waiting": 0},
            "heartbeat_age_s": 0.5, "grpc_address": "127.0.0.1:1"}
    answers = [{"sites": [site], "generated_at": 0.0}, RegistryError(503, "the registry database is unavailable")]

    class Registry:
        def admin_snapshot(self):
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    def sleep(_seconds):
        if not answers:
            raise KeyboardInterrupt  # Ctrl-C after the second frame

    monkeypatch.setattr(cluster.time, "sleep", sleep)
    args = argparse.Namespace(links=False, json=False, interval=1.0)
    assert cluster.watch_status(Registry(), "http://registry", args) == 0
    frames = capsys.readouterr().out.removeprefix(ENTER).removesuffix(LEAVE).split(HOME)[1:]
    assert len(frames) == 2
    assert "lisbon" in frames[0] and "retrying" not in frames[0]
    assert "! registry answered 503: the registry database is unavailable; retrying" in frames[1]
    assert "lisbon" in frames[1]  # the last table stays on screen


@pytest.mark.parametrize("argv, message", [
    (["--log-level", "LOUD", "status"], "argument --log-level: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, "
                                        "got 'LOUD'"),
    (["status", "--registry-url", "http://[::1", "--admin-token", "t"],
     "error: --registry-url: registry URL 'http://[::1' is malformed"),
])
def test_bad_command_line_values_are_named_without_a_traceback(capsys, argv, message):
    from deploy.cli import main

    try:
        code = main(argv)
    except SystemExit as exit_:   # argparse's own refusals
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
