"""The change feed replays: a consumer that was away (a replica down during a promote) gets every
mutation it missed, in order, when it subscribes again; SQLite and a real redis-server alike."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from registry.redis_store import RedisMetadataStore
from registry.sqlite_store import SQLiteMetadataStore
from tests.registry.test_store_suite import add_version


@pytest.fixture(params=["sqlite", "redis"])
def store_factory(request, tmp_path):
    """-> open() giving a new store object on the same data (a process restart)."""
    made = []
    if request.param == "sqlite":
        def open_store():
            made.append(SQLiteMetadataStore(tmp_path / "m.db", poll_interval_s=0.02))
            return made[-1]
    else:
        url, prefix = request.getfixturevalue("redis_server"), f"feed{uuid.uuid4().hex[:8]}"

        def open_store():
            made.append(RedisMetadataStore(url, prefix=prefix))
            return made[-1]
    yield open_store
    for s in made:
        s.close()


class Collector:
    def __init__(self):
        self.events, self._cv = [], threading.Condition()

    def __call__(self, event):
        with self._cv:
            self.events.append(event)
            self._cv.notify_all()

    def wait_for(self, n, timeout=10.0):
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.events) >= n, timeout), self.events
        return self.events


def test_named_consumer_replays_what_it_missed_after_a_restart(store_factory):
    writer = store_factory()
    first = Collector()
    stop = store_factory().subscribe(first, consumer="replica-a")
    time.sleep(0.3)
    writer.update("x", add_version("x"))
    assert [e["revision"] for e in first.wait_for(1)] == [1]
    stop()  # the replica goes down
    for name in ("x", "y", "x"):  # ... and misses a promote-like burst
        writer.update(name, add_version(name))
    again = Collector()
    restarted = store_factory()
    assert restarted.feed_offset("replica-a") == 1
    stop = restarted.subscribe(again, consumer="replica-a")
    try:
        got = again.wait_for(3)
        writer.update("y", add_version("y"))
        got = again.wait_for(4)
    finally:
        stop()
    assert [(e["name"], e["revision"]) for e in got] == [("x", 2), ("y", 3), ("x", 4), ("y", 5)]
    assert restarted.feed_offset("replica-a") == 5


def test_subscribe_after_a_revision_replays_from_there_and_unnamed_starts_now(store_factory):
    s = store_factory()
    for name in ("a", "b", "c"):
        s.update(name, add_version(name))
    replay, live = Collector(), Collector()
    stops = [s.subscribe(replay, after=1), s.subscribe(live)]
    try:
        assert [e["name"] for e in replay.wait_for(2)] == ["b", "c"]
        time.sleep(0.3)
        assert live.events == []
        s.update("d", add_version("d"))
        assert [e["name"] for e in live.wait_for(1)] == ["d"]
        assert [e["name"] for e in replay.wait_for(3)] == ["b", "c", "d"]
    finally:
        for stop in stops:
            stop()
    assert s.feed_offset("nobody") is None


def test_a_consumer_stopped_before_any_event_still_replays_from_its_start(store_factory):
    writer = store_factory()
    writer.update("a", add_version("a"))
    stop = store_factory().subscribe(Collector(), consumer="idle")
    stop()  # down before anything happened
    writer.update("b", add_version("b"))
    again = Collector()
    stop = store_factory().subscribe(again, consumer="idle")
    try:
        assert [(e["name"], e["revision"]) for e in again.wait_for(1)] == [("b", 2)]
    finally:
        stop()


def test_a_failing_callback_does_not_stop_the_feed(store_factory):
    s = store_factory()
    seen = Collector()

    def flaky(event):
        seen(event)
        if event["revision"] == 1:
            raise RuntimeError("boom")

    stop = s.subscribe(flaky, after=0)
    try:
        s.update("a", add_version("a"))
        s.update("a", add_version("a"))
        assert [e["revision"] for e in seen.wait_for(2)] == [1, 2]
    finally:
        stop()
