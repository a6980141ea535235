"""Shared fixtures: small random-weight checkpoints with trained tokenizers."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight Llama checkpoint with a byte-level BPE tokenizer and a chat template."""
    from engine.demo import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("tiny-model"), size="tiny")


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
