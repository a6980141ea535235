"""Clusters starting side by side on one machine (xdist workers, two `edgefire up`) never hand out the
same port: each finds it free before either binds it, so without a shared record both would take it."""

from __future__ import annotations

import multiprocessing

from deploy import processes


def _pick(path: str, num_ports: int, results) -> None:
    processes.PORT_RESERVATIONS = processes.Path(path)
    processes._ephemeral_range = lambda: (processes.FIXED_PORTS_FLOOR + 1000, 60999)  # 1,000 ports to share
    results.put([processes.free_port() for _ in range(num_ports)])


def test_launchers_side_by_side_never_hand_out_one_port_twice(tmp_path):
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    workers = [context.Process(target=_pick, args=(str(tmp_path / "reservations"), 60, results)) for _ in range(4)]
    for worker in workers:
        worker.start()
    picked = [port for _ in workers for port in results.get(timeout=30)]
    for worker in workers:
        worker.join(timeout=30)
    # 240 picks from 1,000 ports: at random, some 28 pairs would collide
    assert len(picked) == 240 and len(set(picked)) == 240


def test_an_unusable_reservation_file_only_loses_the_protection(tmp_path, monkeypatch):
    monkeypatch.setattr(processes, "PORT_RESERVATIONS", tmp_path / "missing-dir" / "reservations")
    assert processes.port_free("127.0.0.1", processes.free_port())
