"""The router's own memory of where it sent each adapter.

Replica reports (routing stats, multiplexed model ids) reach the router a second or more
after the fact; without this memory, the second request for a new adapter could be sent
elsewhere while the first one is still loading it. An entry lives until a replica report
newer than it stops listing the adapter (evicted) or `ttl_s` passes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

__all__ = ["AssignmentMemory"]


@dataclass
class AssignmentMemory:
    ttl_s: float = 30.0
    clock: Callable[[], float] = time.time  # wall clock: compared with replicas' report stamps
    _sent: dict[str, dict[str, float]] = field(default_factory=dict)  # replica -> {adapter: when}

    def note(self, adapter: str, replica: str) -> None:
        self._sent.setdefault(replica, {})[adapter] = self.clock()

    def adapters_on(self, replica: str, reported: frozenset[str], reported_at: Optional[float]) -> frozenset[str]:
        """Adapters we believe `replica` holds or is loading, given its last report.

        `reported` is what the replica said it holds at `reported_at` (None: no report yet).
        """
        now = self.clock()
        sent = self._sent.get(replica, {})
        keep: dict[str, float] = {}
        for adapter, when in sent.items():
            expired = now - when > self.ttl_s
            contradicted = reported_at is not None and reported_at > when and adapter not in reported
            if not expired and not contradicted:
                keep[adapter] = when
        if len(keep) != len(sent):
            self._sent[replica] = keep
        return frozenset(keep)

    def forget_replica(self, replica: str) -> None:
        self._sent.pop(replica, None)
