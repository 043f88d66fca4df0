"""What the data plane offers: the active version of every enabled adapter, per tenant, held in memory.

Built once with paged bulk reads, then kept current from the change feed (the audit log, in revision order):
a change to adapter X re-reads X's serving view only. A read checks the store's revision first (one cheap
query), so a caller sees its own writes; the subscription keeps the catch-up small between reads. A tenant's
view is a tuple rebuilt only after a change, so serving `/v1/models` costs the same at 20 or 20,000 adapters.
"""

from __future__ import annotations

import threading

from registry.metadata_store import MetadataStore
from registry.records import AdapterRecord, AdapterState

__all__ = ["ServingCatalog"]

_PAGE = 1000


def _offered(state: AdapterState | None) -> AdapterRecord | None:
    if state is None or state.disabled or state.active_version is None:
        return None
    return state.versions.get(state.active_version)


class ServingCatalog:
    def __init__(self, store: MetadataStore, subscribe: bool = True):
        self._store = store
        self._lock = threading.RLock()
        self._offered: dict[str, AdapterRecord] = {}
        self._views: dict[str | None, tuple[AdapterRecord, ...]] = {}
        self._applied = 0
        self._reload()
        self._unsubscribe = store.subscribe(lambda _event: self.catch_up()) if subscribe else None

    def _reload(self) -> None:
        with self._lock:
            applied = self._store.revision()  # read first: changes during the scan are replayed by catch_up
            offered: dict[str, AdapterRecord] = {}
            after = None
            while page := self._store.page(after, _PAGE):
                for state in page:
                    if (rec := _offered(state)) is not None:
                        offered[state.name] = rec
                after = page[-1].name
            self._offered, self._views, self._applied = offered, {}, applied

    def catch_up(self) -> None:
        """Apply every change committed since the last one applied (names from the audit log)."""
        with self._lock:
            target = self._store.revision()
            if target <= self._applied:
                return
            names: set[str] = set()
            while self._applied < target:
                entries = self._store.audit(after_seq=self._applied, limit=1000)
                if not entries or entries[0].seq != self._applied + 1:  # trimmed past us: start over
                    self._reload()
                    return
                names.update(e.name for e in entries)
                self._applied = entries[-1].seq
            for name in names:
                rec = _offered(self._store.get_serving_state(name))
                if rec is None:
                    self._offered.pop(name, None)
                else:
                    self._offered[name] = rec
            self._views = {}

    def view(self, tenant: str | None) -> tuple[AdapterRecord, ...]:
        """Active versions of enabled adapters `tenant` may use, by name; the same object until a change."""
        self.catch_up()
        with self._lock:
            view = self._views.get(tenant)
            if view is None:
                view = tuple(r for _, r in sorted(self._offered.items()) if r.visible_to(tenant))
                self._views[tenant] = view
            return view

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
