"""Metadata in one SQLite file (the embedded default). `BEGIN IMMEDIATE` takes the write lock before reading,
so a read-modify-write never interleaves with another writer, across threads and processes alike."""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path
from typing import Callable

from registry.base_model import BaseModelSpec
from registry.metadata_store import Event, Mutation, changed_versions, removed_versions
from registry.records import AdapterRecord, AdapterState, AuditEntry

__all__ = ["SQLiteMetadataStore"]

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS adapters (name TEXT PRIMARY KEY, head TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS versions (name TEXT NOT NULL, version INTEGER NOT NULL, record TEXT NOT NULL,
                                     PRIMARY KEY (name, version));
CREATE TABLE IF NOT EXISTS base_models (name TEXT PRIMARY KEY, spec TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS audit (seq INTEGER PRIMARY KEY, name TEXT NOT NULL, entry TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS audit_name ON audit (name, seq);
CREATE TABLE IF NOT EXISTS tombstones (name TEXT PRIMARY KEY, last_version INTEGER NOT NULL);
"""

# The active and canary records of a page of heads, in one statement (no query per adapter).
_PAGE_SQL = """
SELECT a.name, a.head, v.record FROM (SELECT name, head FROM adapters WHERE name > ? ORDER BY name LIMIT ?) a
LEFT JOIN versions v ON v.name = a.name
 AND v.version IN (json_extract(a.head, '$.active_version'), json_extract(a.head, '$.canary_version'))
ORDER BY a.name
"""
_SERVING_SQL = """
SELECT a.head, v.record FROM adapters a LEFT JOIN versions v ON v.name = a.name
 AND v.version IN (json_extract(a.head, '$.active_version'), json_extract(a.head, '$.canary_version'))
WHERE a.name = ?
"""


class SQLiteMetadataStore:
    def __init__(self, path: str | Path, poll_interval_s: float = 0.5, audit_retention: int = 1_000_000):
        self._path = Path(path)
        self._retention = audit_retention
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._poll = poll_interval_s
        self._local = threading.local()  # one connection per thread: sqlite3 connections are not thread-safe
        with self._conn() as c:
            c.execute("PRAGMA journal_mode=WAL")
            c.executescript(_SCHEMA)

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self._path, timeout=30.0, isolation_level=None)
            self._local.conn = conn
        return conn

    # -- reads ---------------------------------------------------------------------------------------------
    def _read_state(self, c: sqlite3.Connection, name: str) -> AdapterState | None:
        row = c.execute("SELECT head FROM adapters WHERE name = ?", (name,)).fetchone()
        if row is None:
            return None
        state = AdapterState.model_validate_json(row[0])
        recs = c.execute("SELECT version, record FROM versions WHERE name = ? ORDER BY version", (name,)).fetchall()
        return state.model_copy(update={"versions": {v: AdapterRecord.model_validate_json(r) for v, r in recs}})

    def get_state(self, name: str) -> AdapterState | None:
        return self._read_state(self._conn(), name)

    def list_states(self) -> list[AdapterState]:
        names = [r[0] for r in self._conn().execute("SELECT name FROM adapters ORDER BY name")]
        return [s for s in (self.get_state(n) for n in names) if s is not None]

    @staticmethod
    def _views(rows) -> list[AdapterState]:
        out: dict[str, AdapterState] = {}
        for name, head, record in rows:
            state = out.get(name) or AdapterState.model_validate_json(head)
            if record is not None:
                rec = AdapterRecord.model_validate_json(record)
                state.versions[rec.version] = rec
            out[name] = state
        return list(out.values())

    def get_serving_state(self, name: str) -> AdapterState | None:
        views = self._views((name, h, r) for h, r in self._conn().execute(_SERVING_SQL, (name,)).fetchall())
        return views[0] if views else None

    def page(self, after: str | None, limit: int) -> list[AdapterState]:
        return self._views(self._conn().execute(_PAGE_SQL, (after or "", limit)).fetchall())

    def iter_records(self):
        for (record,) in self._conn().execute("SELECT record FROM versions ORDER BY name, version"):
            yield AdapterRecord.model_validate_json(record)

    def get_base_model(self, name: str) -> BaseModelSpec | None:
        row = self._conn().execute("SELECT spec FROM base_models WHERE name = ?", (name,)).fetchone()
        return BaseModelSpec.model_validate_json(row[0]) if row else None

    def list_base_models(self) -> list[BaseModelSpec]:
        rows = self._conn().execute("SELECT spec FROM base_models ORDER BY name").fetchall()
        return [BaseModelSpec.model_validate_json(r[0]) for r in rows]

    def audit(self, name: str | None = None, after_seq: int = 0, limit: int = 100, *, before_seq: int | None = None,
              newest_first: bool = False) -> list[AuditEntry]:
        # Both shapes walk an index: the primary key, or (name, seq).
        where, args = "seq > ? AND seq < ?", [after_seq, before_seq if before_seq is not None else 2**63 - 1]
        if name is not None:
            where, args = "name = ? AND " + where, [name, *args]
        order = "DESC" if newest_first else "ASC"
        rows = self._conn().execute(f"SELECT entry FROM audit WHERE {where} ORDER BY seq {order} LIMIT ?",
                                    (*args, limit))
        return [AuditEntry.model_validate_json(r[0]) for r in rows.fetchall()]

    def revision(self) -> int:
        return self._conn().execute("SELECT COALESCE(MAX(seq), 0) FROM audit").fetchone()[0]

    # -- writes --------------------------------------------------------------------------------------------
    def _transaction(self, body: Callable[[sqlite3.Connection], Mutation]) -> tuple[Mutation, AuditEntry]:
        c = self._conn()
        c.execute("BEGIN IMMEDIATE")
        try:
            mutation = body(c)
            seq = c.execute("SELECT COALESCE(MAX(seq), 0) FROM audit").fetchone()[0] + 1
            entry = mutation.audit.model_copy(update={"seq": seq})
            c.execute("INSERT INTO audit (seq, name, entry) VALUES (?, ?, ?)", (seq, entry.name, entry.model_dump_json()))
            if seq % 1000 == 0:  # retention, amortised: the oldest entries beyond the kept count go
                c.execute("DELETE FROM audit WHERE seq <= ?", (seq - self._retention,))
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        return mutation, entry

    def update(self, name: str, fn: Callable[[AdapterState | None], Mutation]) -> tuple[AdapterState | None, AuditEntry]:
        def body(c: sqlite3.Connection) -> Mutation:
            before = self._read_state(c, name)
            if before is None:
                row = c.execute("SELECT last_version FROM tombstones WHERE name = ?", (name,)).fetchone()
                before = AdapterState(name=name, last_version=row[0]) if row else None
            mutation = fn(before)
            if mutation.delete_adapter:
                last = max(before.last_version, max(before.versions, default=0)) if before else 0
                c.execute("DELETE FROM adapters WHERE name = ?", (name,))
                c.execute("DELETE FROM versions WHERE name = ?", (name,))
                c.execute("INSERT OR REPLACE INTO tombstones (name, last_version) VALUES (?, ?)", (name, last))
            elif mutation.state is not None:
                after = mutation.state
                c.execute("INSERT OR REPLACE INTO adapters (name, head) VALUES (?, ?)",
                          (name, after.model_dump_json(exclude={"versions"})))
                for v in changed_versions(before, after):
                    c.execute("INSERT OR REPLACE INTO versions (name, version, record) VALUES (?, ?, ?)",
                              (name, v, after.versions[v].model_dump_json()))
                for v in removed_versions(before, after):
                    c.execute("DELETE FROM versions WHERE name = ? AND version = ?", (name, v))
            return mutation

        mutation, entry = self._transaction(body)
        return mutation.state, entry

    def update_base_model(self, name: str, fn: Callable[[BaseModelSpec | None], Mutation]) -> AuditEntry:
        def body(c: sqlite3.Connection) -> Mutation:
            row = c.execute("SELECT spec FROM base_models WHERE name = ?", (name,)).fetchone()
            mutation = fn(BaseModelSpec.model_validate_json(row[0]) if row else None)
            if mutation.base_model is not None:
                c.execute("INSERT OR REPLACE INTO base_models (name, spec) VALUES (?, ?)",
                          (name, mutation.base_model.model_dump_json()))
            return mutation

        return self._transaction(body)[1]

    def append_audit(self, entry: AuditEntry) -> AuditEntry:
        return self._transaction(lambda c: Mutation(audit=entry))[1]

    # -- change feed ---------------------------------------------------------------------------------------
    # The audit table is the change feed (seq = revision); a named consumer's offset is kept in feed_offsets,
    # so it resumes where it stopped after a restart.
    def _offsets(self) -> sqlite3.Connection:
        c = self._conn()
        c.execute("CREATE TABLE IF NOT EXISTS feed_offsets (consumer TEXT PRIMARY KEY, seq INTEGER NOT NULL)")
        return c

    def feed_offset(self, consumer: str) -> int | None:
        row = self._offsets().execute("SELECT seq FROM feed_offsets WHERE consumer = ?", (consumer,)).fetchone()
        return None if row is None else row[0]

    def subscribe(self, callback: Callable[[Event], None], *, consumer: str | None = None,
                  after: int | None = None) -> Callable[[], None]:
        """Deliver every mutation after revision `after` (default: the consumer's saved offset, else now),
        in order; SQLite has no push channel, so a daemon thread polls the audit table. -> unsubscribe fn."""
        if after is None and consumer is not None:
            after = self.feed_offset(consumer)
        stop = threading.Event()
        last = self.revision() if after is None else after
        if consumer is not None:  # from now on a restart replays from here at the latest
            self._offsets().execute("INSERT OR REPLACE INTO feed_offsets (consumer, seq) VALUES (?, ?)", (consumer, last))

        def poll() -> None:
            nonlocal last
            while True:
                for e in self.audit(after_seq=last, limit=1000):
                    try:
                        callback({"name": e.name, "action": e.action, "revision": e.seq})
                    except Exception:  # noqa: BLE001 - one bad event must not stop the feed
                        logger.exception("change-feed callback failed at revision %d", e.seq)
                    last = e.seq
                    if consumer is not None:
                        self._offsets().execute("INSERT OR REPLACE INTO feed_offsets (consumer, seq) VALUES (?, ?)",
                                                (consumer, last))
                if stop.wait(self._poll):
                    return

        thread = threading.Thread(target=poll, name="registry-sqlite-poll", daemon=True)
        thread.start()

        def unsubscribe() -> None:
            stop.set()
            thread.join(timeout=5)

        return unsubscribe

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
