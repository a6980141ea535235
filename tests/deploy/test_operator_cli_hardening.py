"""The `edgefire` command line as an operator meets it: two launchers on one state dir, the ports a
cluster picks, a process that keeps dying under `up`, the commands the banner prints, a refused admin
token, a state dir that cannot be written and a prompt that is not UTF-8."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from deploy import cluster as cluster_cli
from deploy import processes
from deploy.cli import main
from deploy.cluster_config import DEFAULT_STATE_DIR, ClusterConfig, demo_sites
from deploy.launcher import Cluster, ClusterError
from deploy.processes import ManagedProcess
from tests.deploy.test_cli_output import ADMIN_TOKEN, registry_url  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[2]

# A launcher that has claimed STATE_DIR and holds it until its stdin closes. The extra argument puts
# the marker of an edgefire process in its command line, as a real `edgefire up` has.
HOLDER = """
import sys
from pathlib import Path
from deploy.cluster_config import ClusterConfig, demo_sites
from deploy.launcher import Cluster
cluster = Cluster(ClusterConfig(model_dir=Path(sys.argv[2]), sites=demo_sites(3), state_dir=Path(sys.argv[1]),
                                router_port=0, registry_port=0))
cluster.claim_state_dir()
print("claimed", flush=True)
sys.stdin.read()
cluster.stop()
"""


def config(tmp_path: Path, **fields) -> ClusterConfig:
    return ClusterConfig(**{"model_dir": tmp_path, "sites": demo_sites(3), "state_dir": tmp_path / "state",
                            "router_port": 0, "registry_port": 0, **fields})


@pytest.fixture
def holder(tmp_path):
    """Another launcher holding tmp_path/state (a process of its own, as a second `edgefire up` sees it)."""
    state_dir = tmp_path / "state"
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(state_dir), str(tmp_path), "deploy.cli-holder"],
                               cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "claimed"
        yield process
    finally:
        process.stdin.close()
        process.wait(timeout=30)


def test_a_second_launcher_is_refused_even_in_the_moment_before_the_first_wrote_its_pid(tmp_path, holder):
    """Two `edgefire up` started together both read launcher.pid before either wrote it, and both ran
    (10 of 15 tries): the claim is a lock now, whatever the file says at that moment."""
    (tmp_path / "state" / "launcher.pid").write_text("")   # the first has opened the file, not yet written
    second = Cluster(config(tmp_path))
    with pytest.raises(ClusterError, match="another launcher .* runs a cluster in"):
        second.claim_state_dir()
    second.stop()   # a refused launcher gives back nothing it does not hold
    assert (tmp_path / "state" / "launcher.pid").exists()

    holder.stdin.close()
    holder.wait(timeout=30)
    second.claim_state_dir()   # the first has stopped: the state dir is free again
    assert (tmp_path / "state" / "launcher.pid").read_text() == str(os.getpid())
    second.stop()
    assert not (tmp_path / "state" / "launcher.pid").exists()


def test_a_refused_up_leaves_the_running_clusters_demo_model_alone(tmp_path, holder, monkeypatch, capsys):
    """`edgefire up --demo-size tiny` beside a running `edgefire up` rewrote the demo model that cluster
    serves, and only then said another launcher runs there."""
    monkeypatch.chdir(tmp_path)
    code = main(["up", "--state-dir", str(tmp_path / "state"), "--demo-size", "tiny", "--port", "0",
                 "--registry-port", "0"])
    err = capsys.readouterr()
    assert code == 1
    assert f"error: another launcher (pid {holder.pid}) runs a cluster in {tmp_path / 'state'}" in err.err
    assert not (tmp_path / ".edgefire" / "demo-model").exists(), err.out


def test_every_port_a_cluster_picks_is_its_own(tmp_path, monkeypatch):
    """Each free port was checked free, not yet bound, and could be picked again for the next process:
    `edgefire up --sites 50` gave two agents one gRPC port in about a third of the starts."""
    fixed = processes.free_port()
    monkeypatch.setattr(processes.random, "randrange", lambda low, high: fixed)   # the same pick every time
    cfg = config(tmp_path, sites=demo_sites(12), routers=2, registry_replicas=2)
    cfg.sites[0].metrics_port = fixed
    cluster = Cluster(cfg)
    cluster._assign_ports()
    ports = [*cluster._registry_ports, *cluster._router_ports, *cluster._router_metrics_ports,
             *(p for s in cfg.sites for p in (s.grpc_port, s.metrics_port))]
    assert len(ports) == 2 + 2 + 2 + 24
    assert len(set(ports)) == len(ports), sorted(ports)
    assert cfg.sites[0].metrics_port == fixed


def test_up_says_once_when_it_leaves_a_process_that_keeps_dying_down(tmp_path, monkeypatch, capsys):
    process = ManagedProcess("lisbon", [sys.executable, "-c", "import sys; sys.exit(3)"],
                             tmp_path / "lisbon.log", tmp_path / "lisbon.pid")

    class Supervised:
        def dead_processes(self):
            return [process] if process.crashed() else []

    process.start()
    naps = []

    def nap(_seconds):
        naps.append(1)
        if len(naps) > 12:
            raise KeyboardInterrupt
        process.popen.wait()   # each start has exited by the next look (blocking: sleep is this function)

    monkeypatch.setattr(cluster_cli.time, "sleep", nap)
    with pytest.raises(KeyboardInterrupt):
        cluster_cli.supervise(Supervised())
    out = capsys.readouterr().out
    assert out.count("lisbon exited with code 3; restarting it") == cluster_cli.MAX_RESTARTS
    assert out.count("leaving it down") == 1
    assert f"lisbon exited with code 3 again after {cluster_cli.MAX_RESTARTS} restarts; leaving it down" in out
    assert str(process.log_path) in out


def banner_command(text: str, command: str) -> list[str]:
    line = next(line for line in text.splitlines() if f"edgefire {command}" in line)
    words = shlex.split(line.split("#")[0])
    return words[words.index("edgefire") + 1:]


def test_the_banners_status_and_usage_commands_find_a_cluster_outside_the_default_state_dir(
        tmp_path, registry_url, monkeypatch, capsys):  # noqa: F811
    """With --state-dir, the banner's `edgefire status --watch` line said "no running `edgefire up`
    cluster" when run as printed."""
    state_dir = tmp_path / "my state"
    cluster = Cluster(config(tmp_path, state_dir=state_dir, admin_token=ADMIN_TOKEN))
    text = cluster_cli.banner(cluster, 1.0)
    state_dir.mkdir()
    (state_dir / "cluster.json").write_text(json.dumps({"registry_url": registry_url, "admin_token": ADMIN_TOKEN}))
    monkeypatch.chdir(tmp_path)
    status = [word for word in banner_command(text, "status") if word != "--watch"]
    assert main(status) == 0
    assert "site-0" in capsys.readouterr().out
    assert main([*banner_command(text, "usage"), "--json"]) == 0
    assert "totals" in json.loads(capsys.readouterr().out)

    default = cluster_cli.banner(Cluster(config(tmp_path, state_dir=DEFAULT_STATE_DIR)), 1.0)
    assert "--state-dir" not in default   # the default needs no flag


@pytest.mark.parametrize("command", ["status", "usage"])
def test_a_refused_admin_token_says_where_it_came_from(tmp_path, registry_url, monkeypatch, capsys,  # noqa: F811
                                                       command):
    """An EDGEFIRE_ADMIN_TOKEN exported for an earlier `edgefire up` wins over the new cluster.json: the
    401 said only "invalid bearer token"."""
    (tmp_path / "cluster.json").write_text(json.dumps({"registry_url": registry_url, "admin_token": ADMIN_TOKEN}))
    monkeypatch.setenv("EDGEFIRE_ADMIN_TOKEN", "efa-from-last-week")
    assert main([command, "--state-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "registry answered 401" in err and "from $EDGEFIRE_ADMIN_TOKEN is not this registry's" in err
    monkeypatch.delenv("EDGEFIRE_ADMIN_TOKEN")
    assert main([command, "--state-dir", str(tmp_path), "--admin-token", "efa-typo"]) == 1
    assert "given with --admin-token is not this registry's" in capsys.readouterr().err
    assert main([command, "--state-dir", str(tmp_path)]) == 0   # cluster.json's own token


@pytest.mark.parametrize("where, why", [("a-file", "it is a file, not a directory"),
                                        ("a-file/state", "Not a directory")])
def test_a_state_dir_that_cannot_be_written_is_one_line(tmp_path, tiny_model_dir, capsys, where, why):
    (tmp_path / "a-file").write_text("")
    code = main(["up", "--model", str(tiny_model_dir), "--state-dir", str(tmp_path / where), "--port", "0",
                 "--registry-port", "0"])
    err = capsys.readouterr().err
    assert code == 1
    assert err == (f"error: state dir {tmp_path / where}: cannot write there ({why}); give a directory this user "
                   f"may write with --state-dir\n")


def test_generate_names_a_prompt_that_is_not_utf8(tiny_model_dir, capsys):
    """`--prompt "$(cat latin1.txt)"`: the tokenizer refused the undecodable bytes with a traceback."""
    prompt = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")   # what Python makes of such argv bytes
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", prompt]) == 2
    assert capsys.readouterr().err == ("error: --prompt: not UTF-8 text (byte 0xe9 at byte 3); give it in UTF-8 "
                                       "(convert it with e.g. `iconv -f latin1 -t utf-8`)\n")
