"""Fixtures shared by the engine tests: the embedded demo model and adapters (built once, then cached)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_paths() -> dict:
    """{"model": dir, "adapters": {name: dir}}: built on first use into $LORASERVE_CACHE or ~/.cache/loraserve
    (about 2-3 minutes on 2 cores), then found there by every later session."""
    from engine_ext.demo import ensure_demo

    return ensure_demo()
