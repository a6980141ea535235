"""`edgefire up`'s supervisor restarts a process that dies, but not an agent that stopped because an operator
deleted its site (exit status 3): restarting it would only be refused again."""

from __future__ import annotations

import pytest

from deploy import cluster as cluster_module
from node_agent.daemon import SITE_DELETED_EXIT_STATUS


class FakeProcess:
    def __init__(self, name: str, code: int, kind: str = "agent") -> None:
        self.name, self.code, self.num_starts, self.log_path, self.kind = name, code, 1, f"/tmp/{name}.log", kind

    def exit_code(self) -> int:
        return self.code

    def start(self) -> None:
        self.num_starts += 1


class FakeCluster:
    def __init__(self, processes: list[FakeProcess], rounds: int) -> None:
        self.processes, self.rounds = processes, rounds

    def dead_processes(self) -> list[FakeProcess]:
        if self.rounds == 0:
            raise KeyboardInterrupt   # Ctrl-C ends the supervisor
        self.rounds -= 1
        return self.processes


def test_an_agent_whose_site_was_deleted_is_left_down_and_others_restart(monkeypatch, capsys):
    assert cluster_module.SITE_DELETED_EXIT_STATUS == SITE_DELETED_EXIT_STATUS
    monkeypatch.setattr(cluster_module.time, "sleep", lambda _s: None)
    deleted, crashed = FakeProcess("agent-lis", SITE_DELETED_EXIT_STATUS), FakeProcess("agent-fra", 1)
    router = FakeProcess("router", SITE_DELETED_EXIT_STATUS, kind="router")   # status 3 means nothing there
    with pytest.raises(KeyboardInterrupt):
        cluster_module.supervise(FakeCluster([deleted, crashed, router], rounds=3))
    assert deleted.num_starts == 1 and crashed.num_starts == 4 and router.num_starts == 4
    out = capsys.readouterr().out
    assert out.count("agent-lis stopped: its site was deleted from the registry") == 1
