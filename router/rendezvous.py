"""Rendezvous (highest-random-weight) hashing: an adapter's home replicas.

Every router process computes the same homes from the same replica set, without
coordination, and a replica joining or leaving moves only the adapters whose top-k
set contained it (about k/n of them), so warm adapter caches mostly survive scaling.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

__all__ = ["rendezvous_score", "home_replicas"]


def rendezvous_score(key: str, node: str) -> int:
    """A stable 64-bit weight of `node` for `key` (same on every host and Python run)."""
    digest = hashlib.blake2b(f"{key}\x00{node}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def home_replicas(key: str, nodes: Iterable[str], k: int) -> list[str]:
    """The `k` nodes with the highest weight for `key`, best first (fewer if fewer nodes)."""
    if k <= 0:
        return []
    ranked = sorted(set(nodes), key=lambda node: (rendezvous_score(key, node), node), reverse=True)
    return ranked[:k]
