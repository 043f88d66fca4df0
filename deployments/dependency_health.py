"""Whether the services the serving layer depends on (the registry's metadata store and blob store, the
rate limiter's Redis) answer, learnt from the outcome of real calls.

One log line when a dependency goes down and one when it is back (with how long it was out), never a line
per failed request; `/ready` and the `loraserve_dependency_up` gauge read the same state. While one is down,
callers that can do without it (the rate limiter's local buckets) skip it for `retry_s` instead of waiting on
it once per request.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["DependencyHealth", "DependencyUnavailable", "DependencyGauge"]

logger = logging.getLogger(__name__)


class DependencyUnavailable(Exception):
    """A dependency is out of reach and no last known answer stands in for it: answer 503, retry later."""

    def __init__(self, dependency: str, reason: str, retry_after_s: float = 2.0):
        super().__init__(f"{dependency} is unreachable ({reason}); retry in a few seconds")
        self.dependency, self.retry_after_s = dependency, retry_after_s


class DependencyHealth:
    def __init__(self, retry_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down: dict[str, tuple[float, float]] = {}  # dependency -> (down since, last failure)
        self._known: set[str] = set()

    def ok(self, dependency: str) -> None:
        with self._lock:
            self._known.add(dependency)
            down = self._down.pop(dependency, None)
        if down is not None:
            logger.warning("%s is reachable again after %.1f s", dependency, self._clock() - down[0])

    def failed(self, dependency: str, error: BaseException) -> None:
        now = self._clock()
        with self._lock:
            self._known.add(dependency)
            first = dependency not in self._down
            self._down[dependency] = (self._down[dependency][0] if not first else now, now)
        if first:
            cause = error.__cause__ or error  # the driver's error under a RegistryUnavailable
            logger.warning("%s is unreachable (%s: %s); serving what does not need it until it is back",
                           dependency, type(cause).__name__, str(cause)[:200])

    def is_down(self, dependency: str) -> bool:
        with self._lock:
            return dependency in self._down

    def should_try(self, dependency: str) -> bool:
        """False while `dependency` failed less than `retry_s` ago: a caller with a fallback uses it at once."""
        with self._lock:
            down = self._down.get(dependency)
        return down is None or self._clock() - down[1] >= self.retry_s

    def status(self) -> dict[str, bool]:
        """dependency -> up, for every dependency called so far."""
        with self._lock:
            return {d: d not in self._down for d in sorted(self._known)}


class DependencyGauge(Collector):
    """`loraserve_dependency_up{dependency}`: 1 while the dependency answers, 0 while it is out of reach."""

    def __init__(self, health: DependencyHealth) -> None:
        self._health = health

    def collect(self) -> Iterable:
        fam = GaugeMetricFamily("loraserve_dependency_up", "1 while the dependency answers, 0 while it is "
                                "unreachable (registry metadata store, blob store, rate-limit Redis)",
                                labels=["dependency"])
        for dependency, up in self._health.status().items():
            fam.add_metric([dependency], 1.0 if up else 0.0)
        yield fam
