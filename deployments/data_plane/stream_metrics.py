"""What one request's trip through the replicas tells /metrics: the observer `ReplicaSession` calls at each step.

It holds the request's labels (adapter, tenant, both possibly "private") and the metrics object, and nothing of the
session's state: each hook is given what it records.
"""

from __future__ import annotations

from typing import Callable, Optional

from deployments.metrics import ServingMetrics

__all__ = ["StreamMetrics"]


class StreamMetrics:
    def __init__(self, metrics: ServingMetrics, adapter: str, tenant: str, clock: Callable[[], float],
                 redact: bool = False):
        """`redact`: the adapter is tenant-private and /metrics open: its name stays out of replica snapshots."""
        self.m, self.labels, self.clock, self.redact = metrics, (adapter, tenant), clock, redact
        self.t0 = clock()
        self._running = False
        self._replica: Optional[str] = None  # the replica this request counts as running on
        self._first_token_t: Optional[float] = None
        self._last_token_t: Optional[float] = None

    # ------------------------------------------------------------------ running
    def running(self) -> None:
        self._running = True
        self.m.running.inc()

    def on_replica(self, first: dict, submitted_at: float) -> None:
        """The replica's first chunk: queue time, batch size, and the replica it runs on."""
        self.m.queue.labels(*self.labels).observe(max(0.0, first.get("started_at", self.t0) - submitted_at))
        if first.get("num_running") is not None:
            self.m.batch.observe(first["num_running"])
        replica = first.get("replica")
        if replica is not None:
            self._replica = str(replica)
            self.m.replica_running.labels(self._replica).inc()

    def off_replica(self) -> None:
        if self._replica is not None:
            self.m.replica_running.labels(self._replica).dec()
            self._replica = None

    def stopped(self) -> None:
        if self._running:
            self._running = False
            self.m.running.dec()
        self.off_replica()

    def retried(self, when: str) -> None:
        """`when`: "before_first_token" (replaced unseen) or "after_first_token" (the stream failed)."""
        self.m.retries.labels(when).inc()
        self._first_token_t = None

    # ------------------------------------------------------------------ tokens
    def token(self, num_tokens: int) -> None:
        now = self.clock()
        if self._first_token_t is None:
            self._first_token_t = now
            self.m.ttft.labels(*self.labels).observe(now - self.t0)
        else:
            self.m.itl.labels(*self.labels).observe((now - self._last_token_t) / max(1, num_tokens))
        self._last_token_t = now

    def ended(self, prompt_tokens: int, completion_tokens: int, replica: Optional[str], snapshot: Optional[dict]) -> None:
        """The replica's end chunk: token counts, decode rate, and the replica's snapshot."""
        self.m.prompt_tokens.labels(*self.labels).inc(prompt_tokens)
        self.m.completion_tokens.labels(*self.labels).inc(completion_tokens)
        if self._first_token_t is not None and completion_tokens > 1:
            elapsed = max(1e-6, self.clock() - self._first_token_t)
            self.m.tps.labels(*self.labels).observe((completion_tokens - 1) / elapsed)
        if snapshot and replica:
            snapshot = dict(snapshot)
            if self.redact:  # a tenant-private adapter's name stays out of /metrics
                snapshot.pop("adapters", None)
            self.m.replicas.update(replica, snapshot)

    def finished(self, status: int, code: Optional[str]) -> None:
        """The request's answer: its status (and error code), end-to-end time."""
        self.m.requests.labels(*self.labels, str(status)).inc()
        if code is not None:
            self.m.errors.labels(*self.labels, code).inc()
        self.m.e2e.labels(*self.labels).observe(self.clock() - self.t0)
        self.stopped()
