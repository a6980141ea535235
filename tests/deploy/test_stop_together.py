"""deploy.processes.stop_together: a tier stopped at once against one shared deadline. Processes never started or
already gone are passed over; those that ignore SIGTERM are killed once the deadline passes, and the warning says
how long each had since its signal (not the little left of the shared deadline when its turn to be waited for came)."""

from __future__ import annotations

import logging
import signal
import time

from deploy.processes import ManagedProcess, stop_together


def _process(tmp_path, name: str, command: str) -> ManagedProcess:
    return ManagedProcess(name, ["sh", "-c", command], tmp_path / f"{name}.log", tmp_path / f"{name}.pid")


def test_a_tier_that_ignores_sigterm_is_killed_at_one_deadline(tmp_path, caplog):
    # each says when its trap is set: a SIGTERM sent before would end the shell (a loaded machine starts it late)
    stubborn = [_process(tmp_path, f"stubborn{i}", f"trap '' TERM; touch {tmp_path}/ready{i}; exec sleep 30")
                for i in range(2)]
    polite = _process(tmp_path, "polite", "exec sleep 30")
    never = _process(tmp_path, "never", "exec sleep 30")
    gone = _process(tmp_path, "gone", "exit 0")
    for process in [*stubborn, polite, gone]:
        process.start()
    gone.popen.wait()
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline, "the stubborn processes never set their trap"
        time.sleep(0.01)
    with caplog.at_level(logging.WARNING, logger="deploy.processes"):
        codes = stop_together([*stubborn, polite, never, gone], signal.SIGTERM, timeout_s=0.6)
    assert codes == {"stubborn0": -signal.SIGKILL, "stubborn1": -signal.SIGKILL, "polite": -signal.SIGTERM,
                     "never": None, "gone": 0}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("did not stop within" in w for w in warnings)
    assert not [w for w in warnings if "within 0s" in w], warnings
    assert not [p for p in stubborn if p.running()] and not (tmp_path / "stubborn1.pid").exists()
