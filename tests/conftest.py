"""Shared fixtures: small random-weight Hugging Face checkpoints built with transformers."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
