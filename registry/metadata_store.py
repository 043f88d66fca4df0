"""The metadata-store interface (SQLite and Redis implement it) and the value a transaction commits.

A store knows nothing about lifecycle rules: it reads one adapter's state, hands it to a pure function that
returns a `Mutation`, and commits the new state, one audit entry and a revision bump atomically (re-running the
function if a concurrent writer got there first). The audit entry's `seq` is the revision it produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from registry.base_model import BaseModelSpec
from registry.records import AdapterState, AuditEntry

__all__ = ["Mutation", "MetadataStore", "Event", "changed_versions", "removed_versions", "serving_view"]

Event = dict[str, Any]  # {"name", "action", "revision"}


@dataclass(frozen=True)
class Mutation:
    audit: AuditEntry  # seq is assigned by the store at commit
    state: AdapterState | None = None  # adapter state to write (None: audit-only)
    base_model: BaseModelSpec | None = None  # base-model spec to write
    delete_adapter: bool = False  # drop the adapter's head and versions; its last version number is kept


class MetadataStore(Protocol):
    def get_state(self, name: str) -> AdapterState | None: ...

    def list_states(self) -> list[AdapterState]: ...

    def get_serving_state(self, name: str) -> AdapterState | None:
        """The head with only its active and canary versions (what a request can be served from)."""
        ...

    def page(self, after: str | None, limit: int) -> list[AdapterState]:
        """Up to `limit` adapters with names > `after`, in name order, as serving views; bulk reads."""
        ...

    def iter_records(self):
        """Every version record of every adapter, read in bulk (garbage collection of blobs)."""
        ...

    def update(self, name: str, fn: Callable[[AdapterState | None], Mutation]) -> tuple[AdapterState | None, AuditEntry]:
        """Atomically: state -> fn(state) -> commit. Exceptions from fn abort with nothing written.
        A deleted adapter reads as a state with no versions whose `last_version` survives, so numbers are never
        reused. -> (state written or None, audit entry with its seq)."""
        ...

    def update_base_model(self, name: str, fn: Callable[[BaseModelSpec | None], Mutation]) -> AuditEntry: ...

    def get_base_model(self, name: str) -> BaseModelSpec | None: ...

    def list_base_models(self) -> list[BaseModelSpec]: ...

    def append_audit(self, entry: AuditEntry) -> AuditEntry:
        """Audit-only mutation (e.g. a registration refused before a version could be recorded)."""
        ...

    def audit(self, name: str | None = None, after_seq: int = 0, limit: int = 100, *, before_seq: int | None = None,
              newest_first: bool = False) -> list[AuditEntry]:
        """Entries with after_seq < seq < before_seq, oldest or newest first; by name through an index."""
        ...

    def revision(self) -> int: ...

    def subscribe(self, callback: Callable[[Event], None], *, consumer: str | None = None,
                  after: int | None = None) -> Callable[[], None]:
        """Call `callback(event)` for every committed mutation after revision `after`, in order (from another
        thread) -> unsubscribe fn. `after` defaults to `consumer`'s saved offset, else the current revision;
        a named consumer's offset advances as events are delivered, so it replays what it missed."""
        ...

    def feed_offset(self, consumer: str) -> int | None: ...

    def close(self) -> None: ...


def changed_versions(before: AdapterState | None, after: AdapterState) -> list[int]:
    """Versions whose record differs, so a commit rewrites only those."""
    old = before.versions if before else {}
    return [v for v, rec in after.versions.items() if old.get(v) != rec]


def removed_versions(before: AdapterState | None, after: AdapterState) -> list[int]:
    return [v for v in (before.versions if before else {}) if v not in after.versions]


def serving_view(state: AdapterState) -> AdapterState:
    keep = {state.active_version, state.canary_version} - {None}
    return state.model_copy(update={"versions": {v: r for v, r in state.versions.items() if v in keep}})
