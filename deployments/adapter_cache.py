"""Which adapters a replica has made known to its engine, and when they may go.

Loading goes through the registry only (`materialize` re-verifies sha256 into a local
cache dir), never through a path from the request. An adapter in use is never pulled
from under a running request: `retire` and `block` mark it, and the last `release`
removes it from the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

__all__ = ["AdapterCache", "AdapterBlocked", "AdapterLease", "adapter_key", "split_key"]


def adapter_key(name: str, version: int) -> str:
    """The engine-level and routing id of one adapter version."""
    return f"{name}@{version}"


def split_key(key: str) -> tuple[str, int]:
    name, _, version = key.rpartition("@")
    return name, int(version)


class AdapterBlocked(Exception):
    """The adapter was disabled or the version withdrawn after the ingress resolved it."""


@dataclass
class _Entry:
    in_use: int = 0
    doomed: bool = False  # remove from the engine when in_use drops to 0
    last_used: float = 0.0


@dataclass
class AdapterLease:
    key: str
    hit: bool  # the adapter was known to the engine when the request arrived
    load_s: float = 0.0


class AdapterCache:
    """Per-replica adapter bookkeeping around an engine's add/remove.

    `load(key) -> awaitable` must fetch and register the adapter with the engine (called
    at most once at a time per key); `unload(key)` removes it from the engine.
    """

    def __init__(
        self,
        load: Callable[[str], Awaitable[Any]],
        unload: Callable[[str], None],
        max_known: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        victim_key: Optional[Callable[[str], Any]] = None,
        protected: Optional[Callable[[str], bool]] = None,
    ):
        if max_known < 1:
            raise ValueError("max_known must be >= 1")
        self._load, self._unload, self._max_known, self._clock = load, unload, max_known, clock
        # eviction order: smallest key first (default: least recently used); protected keys stay
        self._victim_key = victim_key or (lambda k: self._known[k].last_used)
        self._protected = protected or (lambda k: False)
        self._known: OrderedDict[str, _Entry] = OrderedDict()
        self._loading: dict[str, asyncio.Future] = {}
        self._blocked: set[str] = set()  # adapter names (all versions)
        self.loads = 0
        self.load_seconds = 0.0

    # ---------------------------------------------------------------- requests
    async def acquire(self, key: str) -> AdapterLease:
        name, _ = split_key(key)
        if name in self._blocked:
            raise AdapterBlocked(f"adapter {name!r} is disabled")
        entry = self._known.get(key)
        if entry is not None and not entry.doomed:
            self._use(key, entry)
            return AdapterLease(key, hit=True)
        if entry is not None and entry.doomed:
            raise AdapterBlocked(f"adapter version {key!r} is no longer served")
        load_s = await self._ensure_loaded(key)
        if name in self._blocked:  # disabled while we were loading
            raise AdapterBlocked(f"adapter {name!r} is disabled")
        entry = self._known[key]
        self._use(key, entry)
        return AdapterLease(key, hit=False, load_s=load_s)

    def release(self, key: str) -> None:
        entry = self._known.get(key)
        if entry is None:
            return
        entry.in_use -= 1
        if entry.doomed and entry.in_use <= 0:
            self._drop(key)

    # ---------------------------------------------------------------- change feed
    def block(self, name: str) -> None:
        """Disabled: refuse new requests for every version; drop idle ones now, busy ones later."""
        self._blocked.add(name)
        self.retire(name, keep=())

    def unblock(self, name: str) -> None:
        self._blocked.discard(name)

    def retire(self, name: str, keep: tuple[str, ...] | frozenset[str] = ()) -> None:
        """Drop every known version of `name` except the keys in `keep`."""
        for key in [k for k in self._known if split_key(k)[0] == name and k not in keep]:
            entry = self._known[key]
            entry.doomed = True
            if entry.in_use <= 0:
                self._drop(key)

    # ---------------------------------------------------------------- views
    def known(self) -> list[str]:
        return [k for k, e in self._known.items() if not e.doomed]

    def is_known(self, key: str) -> bool:
        entry = self._known.get(key)
        return entry is not None and not entry.doomed

    def draining(self) -> list[str]:
        """Withdrawn versions that still serve requests started before the withdrawal."""
        return [k for k, e in self._known.items() if e.doomed]

    def blocked(self) -> list[str]:
        return sorted(self._blocked)

    def families(self) -> set[str]:
        return {split_key(k)[0] for k in self.known()}

    # ---------------------------------------------------------------- internals
    def _use(self, key: str, entry: _Entry) -> None:
        entry.in_use += 1
        entry.last_used = self._clock()
        self._known.move_to_end(key)

    async def _ensure_loaded(self, key: str) -> float:
        pending = self._loading.get(key)
        if pending is not None:
            await asyncio.shield(pending)
            return 0.0
        fut = asyncio.get_running_loop().create_future()
        self._loading[key] = fut
        start = self._clock()
        try:
            await self._load(key)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # mark retrieved: waiters re-raise it, nobody else must
            raise
        finally:
            self._loading.pop(key, None)
        elapsed = self._clock() - start
        self.loads += 1
        self.load_seconds += elapsed
        self._known[key] = _Entry(last_used=self._clock())
        self._evict_over_capacity(keep=key)
        fut.set_result(None)
        return elapsed

    def _evict_over_capacity(self, keep: str = "") -> None:
        """Drop idle, unprotected adapters in victim order until within `max_known`."""
        over = len(self._known) - self._max_known
        if over <= 0:
            return
        idle = [k for k, e in self._known.items() if e.in_use <= 0 and k != keep and not self._protected(k)]
        for key in sorted(idle, key=self._victim_key)[:over]:
            self._drop(key)

    def _drop(self, key: str) -> None:
        self._known.pop(key, None)
        self._unload(key)
