"""Child processes of the one-machine cluster: start with a log and a pid file, stop by process group.

Each child runs in its own session (`start_new_session=True`), so Ctrl-C in the terminal reaches only
the launcher, which then stops the children in order, and a stop or kill takes the child's whole
process group with it. Pid files let the next launcher clean up after one that crashed.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 15.0
# Only processes whose command line holds this are ever killed from a pid file (pids get reused).
OUR_MARKER = "deploy.cli"


@dataclass(slots=True)
class ManagedProcess:
    name: str
    argv: list[str]
    log_path: Path
    pid_path: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    num_starts: int = 0
    stopped: bool = False                 # stopped on purpose (not a crash)
    kind: str = ""                        # the edgefire command it runs (registry, router, agent); "" for others
    signalled_at: float = 0.0             # time.monotonic() of the last signal_stop (what a kill's warning counts from)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.pid_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            log_file.write(f"--- start {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(self.argv)}\n".encode())
            log_file.flush()
            self.popen = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log_file,
                                          stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                          start_new_session=True)
        self.pid_path.write_text(str(self.popen.pid))
        self.num_starts += 1
        self.stopped = False

    def crashed(self) -> bool:
        """Exited with an error without being asked to (an agent drained by the operator exits 0)."""
        return self.popen is not None and not self.stopped and self.popen.poll() not in (None, 0)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def exit_code(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Signals the process group, waits, then kills it if it has not exited; returns the exit code."""
        self.signal_stop(sig)
        return self.wait_stopped(timeout_s)

    def signal_stop(self, sig: int = signal.SIGTERM) -> None:
        """The first half of stop(): the signal, without waiting (stop_together signals a tier at once)."""
        if self.popen is None:
            return
        self.stopped = True
        self.signalled_at = time.monotonic()
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, sig)

    def wait_stopped(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """The second half of stop(): waits for the exit, kills the group if it has not; the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                # Counted from the signal: under stop_together's shared deadline a later process waits less.
                log.warning("%s did not stop within %.0fs of the signal; killing it", self.name,
                            time.monotonic() - self.signalled_at)
                _signal_group(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        # The leader is gone; make sure nothing it started lingers in its group.
        _signal_group(self.popen.pid, signal.SIGKILL)
        self.pid_path.unlink(missing_ok=True)
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash would: no drain, no deregistration."""
        self.stop(signal.SIGKILL, timeout_s=5.0)

    def log_tail(self, num_lines: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])


def stop_together(processes: Collection[ManagedProcess], sig: int = signal.SIGTERM,
                  timeout_s: float = STOP_TIMEOUT_S) -> dict[str, int | None]:
    """Stops processes at once: every one signalled first, then each waited for until one shared deadline
    (a tier of agents drains side by side instead of one after another). Their exit codes by name."""
    for process in processes:
        process.signal_stop(sig)
    deadline = time.monotonic() + timeout_s
    return {process.name: process.wait_stopped(max(0.0, deadline - time.monotonic())) for process in processes}


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        log.warning("cannot signal process group %d: %s", pid, exc)


def is_ours(pid: int) -> bool:
    """Whether `pid` is alive and one of our children (its command line names deploy.cli)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return _alive(pid)  # no /proc (macOS): trust the pid file
    return OUR_MARKER in cmdline or "edgefire" in cmdline


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_stale(run_dir: Path) -> list[str]:
    """Kills the process groups named by pid files a crashed launcher left; returns their names."""
    killed = []
    for pid_path in sorted(run_dir.glob("*.pid")):
        try:
            pid = int(pid_path.read_text().strip())
        except (OSError, ValueError):
            pid_path.unlink(missing_ok=True)
            continue
        if pid != os.getpid() and is_ours(pid):
            _signal_group(pid, signal.SIGKILL)
            killed.append(pid_path.stem)
        pid_path.unlink(missing_ok=True)
    return killed


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def wait_ports_free(host: str, ports: list[int], timeout_s: float = 10.0) -> list[int]:
    """The ports still taken after `timeout_s` (killed processes release theirs within moments)."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = [p for p in ports if p and not port_free(host, p)]
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.2)


def free_port(host: str = "127.0.0.1", taken: Collection[int] = ()) -> int:
    """A port free now, for a child to bind in a few seconds, and not one of `taken` (ports already
    handed to other children that have not bound them yet: a cluster picks all its ports before
    starting anything, and a free port stays free until bound). Picked below the kernel's ephemeral range
    where there is room: ports there are never handed to outgoing connections, which otherwise (a busy
    client, another cluster starting beside this one) can take a port between this check and the bind."""
    low, _high = _ephemeral_range()
    if low - FIXED_PORTS_FLOOR >= 1000:
        with _reservations() as reserved:
            for _ in range(100):
                port = random.randrange(FIXED_PORTS_FLOOR, low)
                if port not in taken and port not in reserved and port_free(host, port):
                    reserved[port] = time.time()
                    return port
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in taken:
            return port


FIXED_PORTS_FLOOR = 20000   # below this, well-known and registered services
# Ports handed out by any launcher on this machine lately: two clusters starting side by side (tests, or
# two `edgefire up`) could otherwise both find one port free and both hand it out before either binds it.
PORT_RESERVATIONS = Path(tempfile.gettempdir()) / "edgefire-port-reservations"
RESERVATION_S = 120.0       # far longer than a cluster takes to bind what it picked


@contextmanager
def _reservations() -> Iterator[dict[int, float]]:
    """The ports other launchers handed out within RESERVATION_S (port -> when), under a machine-wide lock;
    what the caller adds is kept for the next. An unusable file (another user's, a read-only /tmp) only
    loses the protection."""
    try:
        file = open(PORT_RESERVATIONS, "a+")
    except OSError:
        yield {}
        return
    with file:
        fcntl.flock(file, fcntl.LOCK_EX)
        file.seek(0)
        now = time.time()
        reserved = {}
        for line in file:
            fields = line.split()
            if len(fields) == 2 and fields[0].isdigit():
                try:
                    at = float(fields[1])
                except ValueError:
                    continue
                if now - at < RESERVATION_S:
                    reserved[int(fields[0])] = at
        yield reserved
        file.seek(0)
        file.truncate()
        file.writelines(f"{port} {at:.3f}\n" for port, at in reserved.items())


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999   # Linux's default; macOS starts at 49152
