"""The ranks' processes: starting them, noticing one died, stopping them all, leaving none behind.

Rank 0 starts ranks 1..N-1 as `python -m engine.parallel.worker SPEC`, each holding one end of a
Unix socket pair (SOCK_SEQPACKET: one message per packet, and descriptors can ride along). Over
it a worker reports its start-up (hello, its KV pool, ready) and, before it exits on an error,
the error. The socket is also how each side knows the other is alive:

- rank 0's watchdog thread waits on every worker's socket. End of file (the kernel closes the
  socket when the process dies, however it died) or an exited process marks the engine failed
  within WATCH_INTERVAL_S. It then kills the other workers, so that whatever rank 0's engine thread
  is blocked on fails at once (gloo: the peers' sockets close; NCCL: `on_failure` aborts the
  groups), and the engine raises an error naming the rank and how it died.
- a worker's own thread sees end of file when rank 0 dies, even by SIGKILL, and exits the worker
  at once; it also watches its parent pid, in case a fork of rank 0 inherited the socket. Not
  PR_SET_PDEATHSIG: that fires when the *thread* that started the child exits (say, the executor
  thread an agent loaded the model on), not the process.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5
STOP_GRACE_S = 5.0
MAX_MESSAGE = 1 << 16


@dataclass(slots=True)
class WorkerSpec:
    """Everything a worker needs to start (its command-line argument, as JSON)."""

    rank: int
    model_dir: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    expert_parallel_size: int
    store_port: int
    control_fd: int
    device: str
    dtype: str
    num_threads: int
    engine_config: dict
    log_level: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def send_message(sock: socket.socket, kind: str, fds: list[int] | None = None, **fields) -> None:
    """One control message (JSON) in one packet of at most MAX_MESSAGE bytes; an error's text is shortened to
    fit (cutting the encoded bytes would leave JSON the reader cannot parse)."""
    data = json.dumps({"kind": kind, **fields}).encode()
    if len(data) > MAX_MESSAGE and isinstance(fields.get("error"), str):
        text, keep = fields["error"], len(fields["error"])
        while len(data) > MAX_MESSAGE and keep > 0:  # in proportion: escapes make a character up to 12 bytes
            keep = int(keep * MAX_MESSAGE / len(data) * 0.95)
            fields["error"] = text[:keep] + " [... cut]"
            data = json.dumps({"kind": kind, **fields}).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"control message {kind!r} is {len(data)} bytes, over the {MAX_MESSAGE} a packet holds")
    socket.send_fds(sock, [data], fds or [])


class RankProcesses:
    """Ranks 1..N-1 of one engine, and the watchdog over them."""

    def __init__(self, specs: list[WorkerSpec]):
        self.procs: dict[int, subprocess.Popen] = {}
        self.sockets: dict[int, socket.socket] = {}
        self.inbox: dict[int, queue.Queue] = {}
        self.errors: dict[int, str] = {}        # what a worker said before it exited
        self.failure: str | None = None         # the first rank that died, and how
        self.on_failure = lambda: None          # called on the watchdog thread once a rank failed
        self._stopping = False
        self._failing = False                   # a failure is being handled (published once done)
        self._lock = threading.Lock()
        env = _worker_env(specs[0].num_threads) if specs else {}
        for spec in specs:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            spec.control_fd = theirs.fileno()
            self.procs[spec.rank] = subprocess.Popen(
                [sys.executable, "-m", "engine.parallel.worker", spec.to_json()], pass_fds=[theirs.fileno()], env=env)
            theirs.close()
            self.sockets[spec.rank] = ours
            self.inbox[spec.rank] = queue.Queue()
        self._thread = threading.Thread(target=self._watch, name="rank-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    # -- the watchdog --------------------------------------------------------------------------

    def _watch(self) -> None:
        by_fd = {sock.fileno(): rank for rank, sock in self.sockets.items()}
        open_fds = set(by_fd)
        while not self._stopping and open_fds:
            readable, _, _ = select.select(list(open_fds), [], [], WATCH_INTERVAL_S)
            for fd in readable:
                rank = by_fd[fd]
                try:
                    data, fds, _, _ = socket.recv_fds(self.sockets[rank], MAX_MESSAGE, 4)
                except OSError:
                    data, fds = b"", []
                if not data:
                    open_fds.discard(fd)
                    self._failed(rank)
                    continue
                try:
                    message = json.loads(data)
                except ValueError:  # not a message a worker sends: report it as the rank's error
                    message = {"kind": "error", "error": f"an unreadable control message ({data[:200]!r})"}
                if message["kind"] == "error":
                    self.errors[rank] = message["error"]
                self.inbox[rank].put((message, fds))
            for rank, proc in self.procs.items():
                if proc.poll() is not None:
                    self._failed(rank)

    def _failed(self, rank: int) -> None:
        with self._lock:
            if self._stopping or self._failing:
                return
            self._failing = True
        proc = self.procs[rank]
        try:
            proc.wait(timeout=1.0)  # end of file comes a moment before the exit status
        except subprocess.TimeoutExpired:
            pass
        reason = f"rank {rank} (pid {proc.pid}) {_how(proc, self.errors.get(rank))}"
        log.error("%s; stopping every rank of this engine", reason)
        self.kill()
        self.on_failure()
        self.failure = reason  # published last: whoever sees it finds every rank already gone

    # -- rank 0's engine thread ----------------------------------------------------------------

    def receive(self, rank: int, kind: str, timeout: float) -> tuple[dict, list[int]]:
        """The next message of `kind` from a worker's start-up; raises once any rank failed."""
        deadline = time.monotonic() + timeout
        while True:
            if self.failure is not None:
                raise RuntimeError(self.failure)
            try:
                message, fds = self.inbox[rank].get(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"rank {rank} did not report {kind!r} within {timeout:.0f} s") from None
                continue
            if message["kind"] == kind:
                return message, fds
            for fd in fds:
                os.close(fd)

    def wait_failure(self, timeout: float) -> str | None:
        """The failure the watchdog found, waiting up to `timeout` for it to name one."""
        deadline = time.monotonic() + timeout
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.failure

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()

    def expect_exit(self) -> None:
        """The workers are about to be told to stop: their exits are no failure."""
        with self._lock:
            self._stopping = True

    def stop(self, grace_s: float = 0.0) -> None:
        """Wait up to grace_s for the workers to exit (after a STOP), kill the rest, reap them all."""
        self.expect_exit()
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * WATCH_INTERVAL_S)
        for sock in self.sockets.values():
            sock.close()
        atexit.unregister(self.stop)

    def mark_failed(self, reason: str) -> None:
        """Rank 0 itself failed mid-step: the ranks are out of step, so they all go."""
        with self._lock:
            failing, self._failing = self._failing, True
        if failing:  # the watchdog is on it
            self.wait_failure(timeout=5.0)
            return
        self.kill()
        self.failure = reason


def _how(proc: subprocess.Popen, error: str | None) -> str:
    code = proc.returncode
    if code is None:
        return f"closed its control socket ({error})" if error else "closed its control socket"
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with status {code}" + (f": {error}" if error else "")


def _worker_env(num_threads: int) -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the directory holding the engine package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = str(num_threads)
    return env
