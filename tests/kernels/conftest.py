"""Kernel tests run on the GPU when there is one, else on the CPU under triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection,
ahead of every test module in this folder.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
