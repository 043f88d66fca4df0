"""Which adapter leaves the engine's host cache, by ranks its serving layer sets as data (a core's client cannot
hand it a function): the unpinned candidate with the smallest rank goes; one ranked None stays."""

from __future__ import annotations

__all__ = ["HostEvictionOrder"]


class HostEvictionOrder:
    def __init__(self):
        self._ranks: dict[str, tuple | None] = {}

    def rank(self, updates: dict[str, list | None], replace: bool = False) -> None:
        """name -> its rank (a sequence compared as a tuple: smaller goes first), or None: never evict it.
        replace: forget every rank not in `updates` (a new serving layer's order takes over)."""
        if replace:
            self._ranks.clear()
        for name, rank in updates.items():
            self._ranks[name] = None if rank is None else tuple(rank)

    def choose(self, candidates: list[str]) -> str | None:
        """The victim among `candidates` (least recently used first): the first one never ranked, else the
        smallest rank; None when every candidate is ranked None. (LLMEngine.set_host_eviction's contract.)"""
        ranks = self._ranks
        for name in candidates:
            if name not in ranks:
                return name
        return min((c for c in candidates if ranks[c] is not None), key=ranks.__getitem__, default=None)
