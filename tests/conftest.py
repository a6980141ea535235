"""Shared fixtures: small random-weight checkpoints with trained tokenizers."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist (`make test` runs `--dist loadgroup`), a test file's tests stay on one worker so
    # its module fixtures (a router, an agent, a cluster) start once; the end-to-end files share one
    # cluster and run in their file order (the drain test last), so they form one group. (The files that
    # start clusters of their own stay in it too: beside the shared cluster's fault tests, their start-up
    # load made the router's direct site checks time out.)
    for item in items:
        path = Path(str(item.fspath))
        group = "e2e" if path.parent.name == "e2e" else f"{path.parent.name}/{path.name}"
        item.add_marker(pytest.mark.xdist_group(group))
