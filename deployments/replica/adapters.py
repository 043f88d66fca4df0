"""Which adapter versions a replica offers, on top of the engine, which owns what is resident.

The engine's host cache (`max_cpu_loras` parsed adapters) is the one record of residency: this module asks it
(`host_adapters`) and orders its evictions by ranks it keeps the engine's core up to date with (`rank`: versions
the registry no longer serves first, then the placement's order, never a pinned or warm home), but keeps no list
of its own. What it adds is the serving
state: files come through the registry only (`materialize` re-checks every sha256; never a path from a request),
one load at a time per version; disabled adapters are refused; withdrawn versions are not offered.

A version a request names is served even after it was withdrawn (the ingress resolved it before the change);
versions are immutable, so the engine keeps a registered version for good and re-reads it from disk when it
was evicted.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Iterable, Optional

from deployments.replica.placement import ReplicaPlacement
from router.keys import AdapterKey

__all__ = ["ReplicaAdapters", "AdapterBlocked", "AdapterLoadFailed", "CAUSES"]

CAUSES = ("request", "placement", "change")


class AdapterBlocked(Exception):
    """The adapter was disabled after the ingress resolved it."""


class AdapterLoadFailed(Exception):
    """The adapter's files could not be made servable here (a corrupt blob, a version the registry no longer has, a
    file the engine refused): the service's fault, not the request's."""


class ReplicaAdapters:
    def __init__(self, engine: Any, registry: Any, placement: ReplicaPlacement,
                 clock: Callable[[], float] = time.monotonic):
        self._engine, self._registry, self._placement, self._clock = engine, registry, placement, clock
        self._loading: dict[str, asyncio.Future] = {}
        self._blocked: set[str] = set()  # disabled adapter names (every version)
        self._withdrawn: set[str] = set()  # keys of versions the registry no longer serves
        self._registered_by: dict[str, str] = {}  # key -> what made this replica register it (CAUSES)
        self.rerank(replace=True)  # this replica's order takes over the engine's evictions

    # ---------------------------------------------------------------- requests
    async def acquire(self, key: str, record: Any = None, cause: str = "request") -> tuple[bool, float]:
        """Make `key` servable -> (hit: it was in host memory, seconds spent loading it). `record`: the
        registry's record of the version, as the ingress resolved it (else it is read from the registry);
        `cause` (one of CAUSES): what asks for it, kept for the key when this call is the one that loads it.
        Raises AdapterBlocked, RegistryUnavailable (a store out of reach) or AdapterLoadFailed."""
        if cause not in CAUSES:
            raise ValueError(f"cause must be one of {CAUSES}, not {cause!r}")
        self._check(key)
        hit = key in self._engine.host_adapters()
        if self._engine.has_adapter(key):  # registered: the engine re-reads an evicted one by itself
            return hit, 0.0
        load_s = await self._load_once(key, record, cause)
        self._check(key)  # disabled while it loaded
        return False, load_s

    def _check(self, key: str) -> None:
        name = AdapterKey.family(key)
        if name in self._blocked:
            raise AdapterBlocked(f"adapter {name!r} is disabled")

    async def _load_once(self, key: str, record: Any, cause: str) -> float:
        pending = self._loading.get(key)
        if pending is not None:
            await asyncio.shield(pending)
            return 0.0
        fut = asyncio.get_running_loop().create_future()
        self._loading[key] = fut
        start = self._clock()
        try:
            await self._load(AdapterKey.parse(key), record)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                fut.cancel()
            else:
                fut.set_exception(e)
                fut.exception()  # mark retrieved: waiters re-raise it, nobody else must
            raise
        finally:
            self._loading.pop(key, None)
        fut.set_result(None)
        self._registered_by[key] = cause
        self.rerank([key])
        return self._clock() - start

    async def _load(self, key: AdapterKey, record: Any) -> None:
        """Registry record -> sha256-verified local copy -> engine; what fails but an outage is AdapterLoadFailed."""
        from registry import RegistryError, RegistryUnavailable

        try:
            await self._load_files(key, record)
        except RegistryUnavailable:
            raise
        except (RegistryError, LookupError, ValueError) as e:
            raise AdapterLoadFailed(f"adapter {key} could not be loaded: {e}") from e

    async def _load_files(self, key: AdapterKey, record: Any) -> None:
        if record is None or (record.name, record.version) != (key.name, key.version):
            state = await asyncio.to_thread(self._registry.get, key.name)
            record = state.versions.get(key.version)
            if record is None:
                raise LookupError(f"adapter {key.name!r} has no version {key.version}")
        path = await asyncio.to_thread(self._registry.materialize, record)
        await asyncio.to_thread(self._engine.add_adapter, str(key), str(path))

    # ---------------------------------------------------------------- change feed
    def block(self, name: str) -> None:
        """Disabled: refuse new requests for every version."""
        self._blocked.add(name)

    def unblock(self, name: str) -> None:
        self._blocked.discard(name)

    def retire(self, name: str, keep: frozenset[str] = frozenset()) -> None:
        """Withdraw every version of `name` but the keys in `keep`: no longer offered, evicted first."""
        versions = {k for k in self._withdrawn | set(self._engine.host_adapters()) if AdapterKey.family(k) == name}
        withdrawn = versions - keep
        for key in sorted(withdrawn - self._withdrawn):  # its cached prompt KV would only wait for eviction
            self._engine.drop_cached_prefixes(key)
        self._withdrawn = {k for k in self._withdrawn if AdapterKey.family(k) != name} | withdrawn
        self.rerank(versions)

    # ---------------------------------------------------------------- views
    def known(self) -> list[str]:
        """The versions this replica holds in host memory and offers: the engine's host cache, least recently
        used first, less withdrawn versions and disabled adapters."""
        return [k for k in self._engine.host_adapters()
                if k not in self._withdrawn and AdapterKey.family(k) not in self._blocked]

    def is_known(self, key: str) -> bool:
        return key in self.known()

    def families(self) -> set[str]:
        return {AdapterKey.family(k) for k in self.known()}

    def blocked(self) -> list[str]:
        return sorted(self._blocked)

    def registered_by(self) -> dict[str, str]:
        """key -> what made this replica load it first: "request" (a cold load on the request path),
        "placement" (a home in the plan, prefetched) or "change" (a new version warmed where an older one was)."""
        return dict(self._registered_by)

    # ---------------------------------------------------------------- the engine's evictions
    def rank(self, key: str) -> Optional[tuple]:
        """Where `key` stands in the engine's host-cache evictions (the smallest goes first): withdrawn versions
        first, then the placement's order (homed elsewhere, then tier, then decayed requests); None for pinned and
        warm homes, which stay. A key's rank changes only when its requests, the plan or its withdrawal do."""
        withdrawn = key in self._withdrawn
        if not withdrawn and self._placement.protected(key):
            return None
        return (not withdrawn, *self._placement.victim_key(key))

    def rerank(self, keys: Optional[Iterable[str]] = None, replace: bool = False) -> None:
        """Tell the engine the ranks of `keys` (default: every adapter in its host cache); replace: and forget
        every other rank it was told."""
        keys = self._engine.host_adapters() if keys is None else keys
        self._engine.rank_host_eviction({key: self.rank(key) for key in keys}, replace)

    def note_request(self, key: str) -> None:
        """A request for `key`: it counts in the placement's order, and so in its rank."""
        self._placement.note_request(key)
        self.rerank([key])
