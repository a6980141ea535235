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
