"""The audit log read by adapter through an index, newest first, paged with before_seq, and trimmed to its
retention, on SQLite and a real redis-server."""

from __future__ import annotations

import time
import uuid

import pytest

from registry.records import AuditEntry
from registry.redis_store import RedisMetadataStore
from registry.sqlite_store import SQLiteMetadataStore


@pytest.fixture(params=["sqlite", "redis"])
def make_store(request, tmp_path):
    made = []

    def _make(retention: int = 1_000_000):
        if request.param == "sqlite":
            s = SQLiteMetadataStore(tmp_path / f"{uuid.uuid4().hex}.db", audit_retention=retention)
        else:
            s = RedisMetadataStore(request.getfixturevalue("redis_server"), prefix=f"au{uuid.uuid4().hex[:8]}",
                                   audit_retention=retention)
        made.append(s)
        return s

    yield _make
    for s in made:
        s.close()


def _log(store, name: str, action: str = "x") -> int:
    return store.append_audit(AuditEntry(seq=0, ts=time.time(), actor="t", action=action, name=name)).seq


def test_audit_by_name_newest_first_and_paged(make_store):
    store = make_store()
    seqs = {"a": [], "b": []}
    for i in range(30):
        name = "a" if i % 3 == 0 else "b"
        seqs[name].append(_log(store, name))
    assert [e.seq for e in store.audit("a", limit=4, newest_first=True)] == seqs["a"][::-1][:4]
    older = store.audit("a", limit=100, newest_first=True, before_seq=seqs["a"][-4])
    assert [e.seq for e in older] == seqs["a"][::-1][4:]
    assert [e.seq for e in store.audit("a", after_seq=seqs["a"][2], limit=2)] == seqs["a"][3:5]
    assert {e.name for e in store.audit("b", limit=100)} == {"b"} and len(store.audit("b", limit=100)) == 20


def test_retention_trims_the_oldest_entries(make_store):
    store = make_store(retention=100)
    last = [_log(store, "r" if i % 2 else "s") for i in range(1000)][-1]
    kept = store.audit(limit=10_000)
    assert 100 <= len(kept) <= 250  # Redis trims whole stream nodes ("~"), SQLite every 1000 commits
    assert kept[-1].seq == last == store.revision()
    by_name = store.audit("r", limit=10_000)
    assert len(by_name) <= 250 and by_name[-1].seq == last
