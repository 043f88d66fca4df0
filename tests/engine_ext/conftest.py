"""Fixtures shared by the engine tests: the backend a suite runs on (the demo fixtures are in tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from backends import BACKENDS, skip_unless_available


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> dict:
    """EngineConfig fields of one backend (backends.py): a test asking for it runs once per backend, the GPU
    ones marked `gpu` and skipped where CUDA or Triton is missing."""
    skip_unless_available(request.param)
    return dict(request.param)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module (and the processes it starts): tiny matrices run fastest on one, and on
    a shared 2-core machine a second thread spinning at every barrier made each step up to 30x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
