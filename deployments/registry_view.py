"""The ingress's view of the registry: resolution and listings, with the last known answers kept so that an
outage of the metadata store (Redis) does not stop the adapters already in use.

Every successful read refreshes a bounded, time-limited cache (`max_entries` adapters, answers younger than
`max_age_s`); while the store is unreachable a request for an adapter resolved recently is answered from it
(counted in `loraserve_registry_cached_answers_total`), and anything else is a `DependencyUnavailable` (503).
Resolution itself (visibility, disabled, the canary split) is the registry's own `resolve_version`, on the
fresh or the cached serving state alike.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

from deployments.dependency_health import DependencyHealth, DependencyUnavailable

__all__ = ["RegistryView", "METADATA", "BLOBS", "dependency_name"]

METADATA, BLOBS = "registry metadata store", "registry blob store"


def dependency_name(err: Any) -> str:
    """The DependencyHealth name of a RegistryUnavailable's store."""
    return BLOBS if err.dependency == "blobs" else METADATA


class _Recent:
    """An LRU of (stamp, value), bounded in entries and in age."""

    def __init__(self, max_entries: int, max_age_s: float, clock: Callable[[], float]):
        self._items: OrderedDict[Any, tuple[float, Any]] = OrderedDict()
        self._max_entries, self._max_age_s, self._clock = max_entries, max_age_s, clock
        self._lock = threading.Lock()

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._items[key] = (self._clock(), value)
            self._items.move_to_end(key)
            while len(self._items) > self._max_entries:
                self._items.popitem(last=False)

    def get(self, key: Any) -> tuple[bool, Any]:
        with self._lock:
            item = self._items.get(key)
        if item is None or self._clock() - item[0] > self._max_age_s:
            return False, None
        return True, item[1]


class RegistryView:
    def __init__(self, registry: Any, health: DependencyHealth, cached_answers: Any = None,
                 max_entries: int = 4096, max_age_s: float = 300.0, clock: Callable[[], float] = time.monotonic):
        from registry import RegistryUnavailable
        from registry.resolver import resolve_version

        self._registry, self._health, self._counter = registry, health, cached_answers
        self._unavailable, self._resolve_version = RegistryUnavailable, resolve_version
        self._states = _Recent(max_entries, max_age_s, clock)
        self._listings = _Recent(max_entries, max_age_s, clock)

    def _read(self, what: str, key: Any, cache: _Recent, read: Callable[[], Any]) -> Any:
        """read(), kept in `cache` under `key` when it found something; during an outage the kept answer."""
        try:
            value = read()
        except self._unavailable as e:
            self._health.failed(dependency_name(e), e)
            found, value = cache.get(key)
            if not found:
                raise DependencyUnavailable(METADATA, type(e.__cause__ or e).__name__, e.retry_after_s) from None
            if self._counter is not None:
                self._counter.labels(what).inc()
            return value
        self._health.ok(METADATA)
        if value is not None:
            cache.put(key, value)
        return value

    def resolve(self, name: str, tenant: Optional[str], request_id: Optional[str] = None) -> Any:
        """-> the AdapterRecord serving this request; the registry's AdapterNotFound / AdapterDisabled, or
        DependencyUnavailable for an adapter not resolved recently while the store is out of reach."""
        state = self._read("resolve", name, self._states, lambda: self._registry.serving_state(name))
        return self._resolve_version(state, name, tenant, request_id)

    def list_adapters(self, tenant: Optional[str] = None) -> tuple:
        """The registry's listing for `tenant` (the same object until a change), or the last one during an outage."""
        return self._read("models", tenant, self._listings, lambda: self._registry.list_adapters(tenant))

    def public_names(self) -> set[str]:
        """Names of the public adapters (what an open /metrics may show)."""
        return {r.name for r in self.list_adapters(None)}

    def probe(self) -> dict[str, bool]:
        """Ask both stores now -> dependency -> up, for `/ready` (with what other calls learnt)."""
        for dependency, check in ((METADATA, self._registry.metadata.revision), (BLOBS, self._registry.blobs.ping)):
            try:
                check()
            except self._unavailable as e:
                self._health.failed(dependency, e)
            else:
                self._health.ok(dependency)
        return self._health.status()
