"""Metadata in Redis: optimistic transactions (WATCH the adapter's keys, compute, MULTI/EXEC a Lua commit),
version history in a per-adapter hash, the audit log as a stream whose entry ids are the revisions (also the
change feed replicas follow from their offsets), and a pub/sub channel for listeners that need no replay.

Keys under `prefix`: index (sorted set of adapter names, all score 0, paged by ZRANGEBYLEX), head:{name} (JSON),
versions:{name} (hash version -> record JSON), tombstones (hash name -> last version number of a deleted adapter),
base_models (hash), revision (counter), audit (stream, id "{seq}-0"), audit:{name} (the same entries of one name:
the by-name index), feed_offsets (hash consumer -> seq), channel events. Both audit streams are capped near
`audit_retention` entries.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from typing import Callable

import redis

from registry.base_model import BaseModelSpec
from registry.errors import RegistryUnavailable
from registry.metadata_store import Event, Mutation, changed_versions, removed_versions
from registry.records import AdapterRecord, AdapterState, AuditEntry

__all__ = ["RedisMetadataStore"]

logger = logging.getLogger(__name__)

# The commit runs inside MULTI after WATCH, so it only executes if no watched key changed; doing it in Lua lets
# the revision counter, the audit stream id and the published event all use the same freshly incremented value.
# The audit JSON is stored verbatim (re-encoding in Lua would turn {} into [] and round floats); its seq is the
# stream id.
# KEYS: revision, audit, index, head, versions, base_models, name_audit, tombstones
# ARGV: channel, name, action, audit_json, writes_json, retention
_COMMIT_LUA = """
local rev = redis.call('INCR', KEYS[1])
local writes = cjson.decode(ARGV[5])
if writes['delete'] then
  redis.call('ZREM', KEYS[3], ARGV[2])
  redis.call('DEL', KEYS[4], KEYS[5])
  redis.call('HSET', KEYS[8], ARGV[2], writes['delete'])
end
if writes['head'] then
  redis.call('ZADD', KEYS[3], 0, ARGV[2])
  redis.call('SET', KEYS[4], writes['head'])
end
for v, rec in pairs(writes['versions']) do redis.call('HSET', KEYS[5], v, rec) end
for _, v in ipairs(writes['removed'] or {}) do redis.call('HDEL', KEYS[5], v) end
if writes['base_model'] then redis.call('HSET', KEYS[6], ARGV[2], writes['base_model']) end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], rev .. '-0', 'name', ARGV[2], 'entry', ARGV[4])
redis.call('XADD', KEYS[7], 'MAXLEN', '~', ARGV[6], rev .. '-0', 'entry', ARGV[4])
redis.call('PUBLISH', ARGV[1], cjson.encode({name = ARGV[2], action = ARGV[3], revision = rev}))
return rev
"""

# KEYS: head:{name} for n names, then versions:{name} for the same names. -> per name {head, active, canary}
# ('' where absent: a nil would cut the reply short).
_SERVING_LUA = """
local n = #KEYS / 2
local out = {}
for i = 1, n do
  local head = redis.call('GET', KEYS[i])
  local row = {'', '', ''}
  if head then
    row[1] = head
    local h = cjson.decode(head)
    for j, field in ipairs({'active_version', 'canary_version'}) do
      local v = h[field]
      if v and v ~= cjson.null then row[j + 1] = redis.call('HGET', KEYS[n + i], string.format('%d', v)) or '' end
    end
  end
  out[i] = row
end
return out
"""


# A Redis that cannot be reached (refused, reset, timed out, still loading its data after a restart).
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError)


def _reachable(method):
    """Redis out of reach is RegistryUnavailable (the caller answers 503 and retries), not a driver error."""
    @functools.wraps(method)
    def call(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except _UNREACHABLE as e:
            raise RegistryUnavailable("metadata", e) from e
    return call


class RedisMetadataStore:
    def __init__(self, url: str | None = None, prefix: str = "loraserve:registry", *,
                 client: redis.Redis | None = None, max_retries: int = 1000, audit_retention: int = 1_000_000,
                 timeout_s: float = 5.0):
        # Timeouts bound how long a call waits on a Redis that stopped answering (the feed's XREAD blocks
        # 250 ms, well within them).
        self._r = client or redis.Redis.from_url(url, decode_responses=True, socket_timeout=timeout_s,
                                                 socket_connect_timeout=timeout_s)
        self._p = prefix
        self._retention = audit_retention
        self._max_retries = max_retries
        self._commit = self._r.register_script(_COMMIT_LUA)
        self._serving = self._r.register_script(_SERVING_LUA)

    def _k(self, *parts: str) -> str:
        return ":".join((self._p, *parts))

    # -- reads ---------------------------------------------------------------------------------------------
    @staticmethod
    def _decode_state(head: str | None, versions: dict[str, str]) -> AdapterState | None:
        if head is None:
            return None
        state = AdapterState.model_validate_json(head)
        recs = {int(v): AdapterRecord.model_validate_json(r) for v, r in sorted(versions.items(), key=lambda kv: int(kv[0]))}
        return state.model_copy(update={"versions": recs})

    @_reachable
    def get_state(self, name: str) -> AdapterState | None:
        pipe = self._r.pipeline(transaction=True)  # MULTI so head and versions come from one instant
        pipe.get(self._k("head", name)).hgetall(self._k("versions", name))
        head, versions = pipe.execute()
        return self._decode_state(head, versions)

    @_reachable
    def list_states(self) -> list[AdapterState]:
        names = self._r.zrange(self._k("index"), 0, -1)
        return [s for s in (self.get_state(n) for n in names) if s is not None]

    def _serving_views(self, names: list[str]) -> list[AdapterState]:
        """Heads of `names` with their active and canary records, in one script call (one instant: a head never
        comes back without the records it points at)."""
        if not names:
            return []
        keys = [self._k("head", n) for n in names] + [self._k("versions", n) for n in names]
        out = []
        for n, (head, active, canary) in zip(names, self._serving(keys=keys)):
            if not head:
                continue
            found = [AdapterRecord.model_validate_json(r) for r in (active, canary) if r]
            out.append(AdapterState.model_validate_json(head).model_copy(update={"versions": {r.version: r for r in found}}))
        return out

    @_reachable
    def get_serving_state(self, name: str) -> AdapterState | None:
        views = self._serving_views([name])
        return views[0] if views else None

    @_reachable
    def page(self, after: str | None, limit: int) -> list[AdapterState]:
        start = f"({after}" if after else "-"
        return self._serving_views(self._r.zrangebylex(self._k("index"), start, "+", start=0, num=limit))

    def iter_records(self):
        after = None
        try:
            while names := self._r.zrangebylex(self._k("index"), f"({after}" if after else "-", "+", start=0,
                                               num=500):
                pipe = self._r.pipeline(transaction=False)
                for n in names:
                    pipe.hvals(self._k("versions", n))
                for recs in pipe.execute():
                    yield from (AdapterRecord.model_validate_json(r) for r in recs)
                after = names[-1]
        except _UNREACHABLE as e:
            raise RegistryUnavailable("metadata", e) from e

    @_reachable
    def get_base_model(self, name: str) -> BaseModelSpec | None:
        raw = self._r.hget(self._k("base_models"), name)
        return BaseModelSpec.model_validate_json(raw) if raw else None

    @_reachable
    def list_base_models(self) -> list[BaseModelSpec]:
        raw = self._r.hgetall(self._k("base_models"))
        return [BaseModelSpec.model_validate_json(raw[n]) for n in sorted(raw)]

    @_reachable
    def audit(self, name: str | None = None, after_seq: int = 0, limit: int = 100, *, before_seq: int | None = None,
              newest_first: bool = False) -> list[AuditEntry]:
        # By name, the per-name stream is the index: no scan of other adapters' entries.
        key = self._k("audit") if name is None else self._k("audit", name)
        low, high = f"({after_seq}-0", f"({before_seq}-0" if before_seq is not None else "+"
        if newest_first:
            batch = self._r.xrevrange(key, max=high, min=low, count=limit)
        else:
            batch = self._r.xrange(key, min=low, max=high, count=limit)
        return [AuditEntry.model_validate_json(fields["entry"]).model_copy(update={"seq": int(sid.split("-")[0])})
                for sid, fields in batch]

    @_reachable
    def revision(self) -> int:
        return int(self._r.get(self._k("revision")) or 0)

    # -- writes --------------------------------------------------------------------------------------------
    def _transact(self, watch: list[str], read: Callable[[redis.client.Pipeline], object],
                  compute: Callable[[object], tuple[Mutation, dict]], name: str) -> tuple[Mutation, AuditEntry]:
        keys = [self._k("revision"), self._k("audit"), self._k("index"), self._k("head", name),
                self._k("versions", name), self._k("base_models"), self._k("audit", name), self._k("tombstones")]
        for _ in range(self._max_retries):
            with self._r.pipeline(transaction=True) as pipe:
                try:
                    if watch:
                        pipe.watch(*watch)
                    mutation, writes = compute(read(pipe))
                    pipe.multi()
                    self._commit(keys=keys, args=[self._k("events"), name, mutation.audit.action,
                                                  mutation.audit.model_dump_json(), json.dumps(writes),
                                                  self._retention], client=pipe)
                    (seq,) = pipe.execute()
                except redis.WatchError:
                    continue  # a concurrent writer committed first: re-read and re-run the pure function
            return mutation, mutation.audit.model_copy(update={"seq": int(seq)})
        raise RuntimeError(f"redis transaction on {name!r} did not converge after {self._max_retries} retries")

    @_reachable
    def update(self, name: str, fn: Callable[[AdapterState | None], Mutation]) -> tuple[AdapterState | None, AuditEntry]:
        head_key, versions_key, tomb_key = self._k("head", name), self._k("versions", name), self._k("tombstones")

        def read(pipe):
            state = self._decode_state(pipe.get(head_key), pipe.hgetall(versions_key))
            if state is None and (last := pipe.hget(tomb_key, name)) is not None:
                state = AdapterState(name=name, last_version=int(last))
            return state

        def compute(before):
            mutation = fn(before)
            writes: dict = {"versions": {}}
            if mutation.delete_adapter:
                writes["delete"] = max(before.last_version, max(before.versions, default=0)) if before else 0
            elif mutation.state is not None:
                after = mutation.state
                writes["head"] = after.model_dump_json(exclude={"versions"})
                writes["versions"] = {str(v): after.versions[v].model_dump_json() for v in changed_versions(before, after)}
                writes["removed"] = [str(v) for v in removed_versions(before, after)]
            return mutation, writes

        mutation, entry = self._transact([head_key, versions_key, tomb_key], read, compute, name)
        return mutation.state, entry

    @_reachable
    def update_base_model(self, name: str, fn: Callable[[BaseModelSpec | None], Mutation]) -> AuditEntry:
        def read(pipe):
            raw = pipe.hget(self._k("base_models"), name)
            return BaseModelSpec.model_validate_json(raw) if raw else None

        def compute(before):
            mutation = fn(before)
            writes: dict = {"versions": {}}
            if mutation.base_model is not None:
                writes["base_model"] = mutation.base_model.model_dump_json()
            return mutation, writes

        return self._transact([self._k("base_models")], read, compute, name)[1]

    @_reachable
    def append_audit(self, entry: AuditEntry) -> AuditEntry:
        return self._transact([], lambda pipe: None, lambda _: (Mutation(audit=entry), {"versions": {}}),
                              entry.name)[1]

    # -- change feed ---------------------------------------------------------------------------------------
    # The audit stream is the change feed: its entry ids are the revisions, so a subscriber reads it with
    # XREAD from an offset and replays whatever it missed. A named consumer's offset is kept in the hash
    # `feed_offsets`, so it resumes where it stopped after a restart or a lost connection.
    @_reachable
    def feed_offset(self, consumer: str) -> int | None:
        raw = self._r.hget(self._k("feed_offsets"), consumer)
        return None if raw is None else int(raw)

    @_reachable
    def subscribe(self, callback: Callable[[Event], None], *, consumer: str | None = None,
                  after: int | None = None) -> Callable[[], None]:
        """Deliver every mutation after revision `after` (default: the consumer's saved offset, else now),
        in order, on a daemon thread; then follow new ones. -> unsubscribe fn."""
        if after is None and consumer is not None:
            after = self.feed_offset(consumer)
        start = self.revision() if after is None else after
        if consumer is not None:  # from now on a restart replays from here at the latest
            self._r.hset(self._k("feed_offsets"), consumer, start)
        stop = threading.Event()
        reader = redis.Redis(connection_pool=self._r.connection_pool)

        def follow() -> None:
            last = start
            while not stop.is_set():
                try:
                    batch = reader.xread({self._k("audit"): f"{last}-0"}, count=500, block=250)
                except redis.RedisError:
                    stop.wait(0.5)  # reconnect and resume from `last`: nothing is skipped
                    continue
                for _stream, entries in batch or []:
                    for sid, fields in entries:
                        seq = int(sid.split("-")[0])
                        action = json.loads(fields["entry"]).get("action")
                        try:
                            callback({"name": fields["name"], "action": action, "revision": seq})
                        except Exception:  # noqa: BLE001 - one bad event must not stop the feed
                            logger.exception("change-feed callback failed at revision %d", seq)
                        last = seq
                        if consumer is not None:
                            try:
                                self._r.hset(self._k("feed_offsets"), consumer, seq)
                            except redis.RedisError:
                                logger.warning("could not save feed offset of %s", consumer)

        thread = threading.Thread(target=follow, name="registry-redis-feed", daemon=True)
        thread.start()

        def unsubscribe() -> None:
            stop.set()
            thread.join(timeout=5)

        return unsubscribe

    def close(self) -> None:
        self._r.close()

