"""Fixtures shared by the engine tests: the backend a suite runs on (the demo fixtures are in tests/conftest.py)."""
from __future__ import annotations

import pytest

from backends import BACKENDS, skip_unless_available


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> dict:
    """EngineConfig fields of one backend (backends.py): a test asking for it runs once per backend, the GPU
    ones marked `gpu` and skipped where CUDA or Triton is missing."""
    skip_unless_available(request.param)
    return dict(request.param)
