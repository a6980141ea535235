"""Shared fixtures: small random-weight checkpoints with trained tokenizers."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Kernel tests run under triton's interpreter on a machine without an NVIDIA GPU, which must be chosen before
# triton is first imported, by whichever test module imports it first: transformers' vision models import it at
# collection, before tests/kernels' own conftest is read. Decided without importing torch (it would slow every
# worker's start and hide what a module imports); tests/kernels/conftest.py decides again with torch.
if not any(os.path.exists(device) for device in ("/dev/nvidiactl", "/dev/nvidia0")):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight Llama checkpoint with a byte-level BPE tokenizer and a chat template."""
    from engine.demo import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("tiny-model"), size="tiny")


@dataclass(frozen=True, slots=True)
class TLSFiles:
    ca: str     # the CA bundle (PEM) that signed cert
    cert: str   # valid for 127.0.0.1 and localhost, for serving and as a client certificate
    key: str


@pytest.fixture(scope="session")
def local_tls(tmp_path_factory) -> TLSFiles:
    """A local CA and one certificate it signed, as PEM files (deploy.tls, as `edgefire up --tls` makes them)."""
    from deploy.tls import LocalCA

    directory = tmp_path_factory.mktemp("tls")
    ca = LocalCA()
    cert, key = ca.issue("test", ["127.0.0.1", "localhost"])
    for name, pem in (("ca.pem", ca.cert_pem), ("cert.pem", cert), ("key.pem", key)):
        (directory / name).write_bytes(pem)
    return TLSFiles(*(str(Path(directory) / name) for name in ("ca.pem", "cert.pem", "key.pem")))


_exit_status = 0


def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # triton's native bindings print hundreds of spurious "leaked function" lines at interpreter
    # teardown, after pytest's summary. Once pytest is done, skip that teardown so the summary
    # stays the last thing printed (and the exit status stays pytest's own).
    import sys

    if "triton" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status)


def work_unit(nodeid: str) -> str:
    """The xdist work unit a test belongs to: its file, or `tests/e2e` for every end-to-end file."""
    path = Path(nodeid.split("::", 1)[0])
    return str(path.parent) if path.parent.name == "e2e" else str(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # Under pytest-xdist (`make test` runs `--dist loadgroup`), a test file's tests stay on one worker so
    # its module fixtures (a router, an agent, a cluster) start once; the end-to-end files share one
    # cluster and run in their file order (the drain test last), so they form one group. (The files that
    # start clusters of their own stay in it too: beside the shared cluster's fault tests, their start-up
    # load made the router's direct site checks time out.)
    # The groups are named here, from each test's node id, rather than by xdist_group marks: xdist reads
    # those by rewriting node ids, which pytest 9 no longer honours, so every test became a group of its
    # own and each worker built every module's fixtures and started its own end-to-end clusters.
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    # Groups go out in file order, not largest first: the end-to-end fleet file, one test of two minutes,
    # would otherwise start last and run alone at the end. In file order the two long groups (tests/e2e,
    # tests/e2e_fleet) start side by side early in the run and the short ones fill in around them.
    config.option.loadscopereorder = False
    return FileGroupScheduling(config, log)
