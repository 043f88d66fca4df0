"""One LLM replica: an `AsyncLLMEngine`, its adapters (loaded through the registry only),
routing stats for `router.AffinityRouter`, and the registry's change feed.

`LLMServer` is a plain class (engine and registry injected, so tests can build it without
Ray); `deployments.application` wraps it as the Serve deployment `LLMServer`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from deployments.adapter_cache import AdapterBlocked, AdapterCache, adapter_key, split_key
from deployments.config import AppConfig
from deployments.protocol import GenerateRequest, error_chunk
from deployments.replica_placement import ReplicaPlacement
from router.placement import TIER_PINNED, PlacementConfig

__all__ = ["LLMServer", "engine_config"]

logger = logging.getLogger(__name__)


def engine_config(cfg: AppConfig, model_dir: str):
    """The replica's `EngineConfig`: the app's resolved `engine` section on `model_dir`."""
    from deployments.engine_settings import build_engine_config

    return build_engine_config(cfg.engine, model_dir)


@dataclass
class _AdapterCounters:
    hits: int = 0
    misses: int = 0
    loads: int = 0
    load_seconds: float = 0.0


class _Refused(Exception):
    """A request the replica refuses before any work: (code, message, param) of a 400."""

    def __init__(self, code: str, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.code, self.param = code, param


async def _merge(streams: list, firsts: list) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, RequestOutput) from every engine stream as they come; closing it aborts the unfinished."""
    for i, out in enumerate(firsts):
        yield i, out
    if len(streams) == 1:  # n = 1, nearly every request: no task and no wait() per token
        try:
            if not firsts[0].finished:
                async for out in streams[0]:
                    yield 0, out
        finally:
            await streams[0].aclose()  # aborts the request if it is unfinished
        return
    nexts = {asyncio.ensure_future(streams[i].__anext__()): i for i, out in enumerate(firsts) if not out.finished}
    try:
        while nexts:
            done, _ = await asyncio.wait(nexts, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = nexts.pop(fut)
                out = fut.result()
                if not out.finished:
                    nexts[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, out
    finally:
        for fut in nexts:
            fut.cancel()
        await asyncio.gather(*nexts, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)  # aborts unfinished requests


class LLMServer:
    def __init__(self, cfg: AppConfig, engine: Any, registry: Any, replica_id: str,
                 publish_residency: Optional[Callable[[list[str], dict], None]] = None,
                 clock: Callable[[], float] = time.time,
                 placement_sync: Optional[Callable[[str, dict], Awaitable[dict]]] = None):
        self.cfg, self.engine, self.registry, self.replica_id = cfg, engine, registry, replica_id
        self._publish = publish_residency
        self._clock = clock
        # (replica id, this replica's report()) -> {"version", "tiers": {family: tier}}: the heartbeat that
        # fetches the plan also carries the replica's metrics to the ingresses, on a timer
        self._placement_sync = placement_sync
        self.placement = ReplicaPlacement(PlacementConfig(**cfg.placement), clock)
        # A replica "holds" as many adapters as the engine keeps in host memory; beyond that the idle
        # one the placement values least is dropped (homed elsewhere, then tier, then decayed request
        # count), so routing stats match what is really resident. Pinned and warm homes stay.
        self.adapters = AdapterCache(self._load_adapter, self._forget_adapter, max_known=cfg.max_cpu_loras,
                                     victim_key=self.placement.victim_key, protected=self.placement.protected)
        self.counters: dict[str, _AdapterCounters] = defaultdict(_AdapterCounters)
        self._ongoing = 0
        self._stats: dict[str, Any] = {}
        self._stats_seq = 0  # bumped on every read of engine.stats(): orders this replica's reports
        self._tasks: set[asyncio.Task] = set()
        self._unsubscribe: Optional[Callable[[], None]] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._prompt_limits: Optional[tuple[int, int]] = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._read_stats()
        self._spawn(self._stats_loop())
        # Follow the change feed as a named consumer: started again after a stop (say, during a promote),
        # this replica replays what it missed from its saved offset; the first time it starts from now.
        self._unsubscribe = self.registry.subscribe(self._on_registry_event, consumer=f"replica:{self.replica_id}")
        if self._placement_sync is not None:
            self._spawn(self._placement_loop())

    async def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        for t in list(self._tasks):
            t.cancel()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read_stats(self) -> None:
        # engine.stats() takes the engine lock that step() holds: read it off the event loop.
        stats = await asyncio.to_thread(self.engine.stats)
        self._stats, self._stats_seq = stats, self._stats_seq + 1

    async def _stats_loop(self, period_s: float = 0.5) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await self._read_stats()
            except Exception:  # noqa: BLE001 - stats are advisory
                logger.exception("engine.stats() failed")

    # ------------------------------------------------------------------ adapters
    async def _load_adapter(self, key: str) -> None:
        """Registry record -> sha256-verified local copy -> engine. Never a path from a request."""
        name, version = split_key(key)
        state = await asyncio.to_thread(self.registry.get, name)
        rec = state.versions.get(version)
        if rec is None:
            raise LookupError(f"adapter {name!r} has no version {version}")
        path = await asyncio.to_thread(self.registry.materialize, rec)
        await asyncio.to_thread(self.engine.add_adapter, key, str(path))
        self.counters[key].loads += 1

    def _forget_adapter(self, key: str) -> None:
        """The replica stops offering `key`; the engine keeps the registration on purpose.

        The engine maps a name to one set of weights for life and refuses to re-add a removed
        name until it has left its device slot, which an idle engine never does; our keys are
        immutable registry versions, so keeping them registered is safe, lets a rollback or
        enable serve the version again at once, and the engine's own LRU frees the memory.
        """
        logger.debug("adapter %s no longer offered by replica %s", key, self.replica_id)

    def _publish_residency(self) -> None:
        # Tell Serve's controller at once (instead of at the next stats period), so routers see the
        # new resident adapter within a broadcast, not seconds later.
        if self._publish is not None:
            try:
                self._publish(self.adapters.known(), self.record_routing_stats())
            except Exception:  # noqa: BLE001 - advisory
                logger.debug("publishing residency failed", exc_info=True)

    def _on_registry_event(self, event: dict) -> None:
        # Called on the registry's subscriber thread.
        if self._loop is not None and isinstance(event, dict) and event.get("name"):
            self._loop.call_soon_threadsafe(self._spawn, self.apply_change(event["name"]))

    async def apply_change(self, name: str) -> None:
        """Promote/rollback/canary/disable of `name`: drop versions no longer served, refuse
        disabled ones, prefetch the new active version where an older one was resident."""
        from registry import AdapterNotFound

        try:
            state = await asyncio.to_thread(self.registry.get, name)
        except AdapterNotFound:
            return
        if state.disabled:
            self.adapters.block(name)
            self._publish_residency()
            return
        self.adapters.unblock(name)
        serving = {adapter_key(name, v) for v in (state.active_version, state.canary_version) if v is not None}
        was_resident = name in self.adapters.families()
        self.adapters.retire(name, keep=frozenset(serving))
        # warm the versions about to take traffic (active, canary) where an older one lives
        for version in (state.active_version, state.canary_version) if was_resident else ():
            key = adapter_key(name, version) if version is not None else None
            if key is not None and not self.adapters.is_known(key):
                try:
                    lease = await self.adapters.acquire(key)
                    self.adapters.release(lease.key)
                except Exception:  # noqa: BLE001 - a prefetch failure surfaces on the next request
                    logger.exception("prefetch of %s failed", key)
        self._publish_residency()

    # ------------------------------------------------------------------ placement
    async def _placement_loop(self) -> None:
        while True:
            try:
                self.placement.share = await self._placement_sync(self.replica_id, self.report())
                await self.apply_placement()
            except Exception:  # noqa: BLE001 - advisory: keep serving on the last plan
                logger.warning("placement sync failed", exc_info=True)
            await asyncio.sleep(self.cfg.placement_period_s)

    async def apply_placement(self) -> None:
        """Load the active version of every pinned and warm adapter homed here (pinned ones into a
        device slot, pinned in the engine), unpin what left the pinned tier. Loads run on worker
        threads and the device copy rides a one-token request, so decoding never waits on them."""
        from registry import AdapterNotFound

        wanted_pins: set[str] = set()
        for family, tier in self.placement.wanted():
            try:
                state = await asyncio.to_thread(self.registry.get, family)
            except AdapterNotFound:
                continue
            if state.disabled or state.active_version is None:
                continue
            key = adapter_key(family, state.active_version)
            if not self.adapters.is_known(key):
                try:
                    lease = await self.adapters.acquire(key)
                    self.adapters.release(lease.key)
                    self._publish_residency()
                except Exception:  # noqa: BLE001 - surfaces on the next request for it
                    logger.exception("prefetch of %s failed", key)
                    continue
            if tier == TIER_PINNED:
                wanted_pins.add(key)
        for key in self.placement.pinned - wanted_pins:
            self._set_pinned(key, False)
        for key in wanted_pins:
            self._set_pinned(key, True)
            if key not in self._stats.get("device_adapters", ()):
                await self._warm_device(key)
        self.placement.pinned = wanted_pins

    def _set_pinned(self, key: str, pinned: bool) -> None:
        # The engine's adapter manager owns pins; AsyncLLMEngine exposes its LLMEngine as `.engine`.
        self.engine.engine.adapters.set_pinned(key, pinned)

    async def _warm_device(self, key: str) -> None:
        """Put `key` in a device slot now: a one-token request on it (the scheduler activates it
        beside the running batch, as for any request)."""
        from engine_ext import SamplingParams

        stream = self.engine.generate(None, prompt_token_ids=[1], sampling_params=SamplingParams(max_tokens=1),
                                      adapter_name=key, request_id=f"warm-{key}-{time.monotonic_ns()}")
        try:
            async for _ in stream:
                pass
        finally:
            await stream.aclose()
        await self._read_stats()

    # ------------------------------------------------------------------ requests
    async def generate(self, req: GenerateRequest) -> AsyncIterator[dict]:
        started_at = self._clock()
        self._ongoing += 1
        lease = None
        try:
            if req.adapter_key is not None:
                try:
                    lease = await self.adapters.acquire(req.adapter_key)
                except AdapterBlocked as e:
                    yield error_chunk(403, "model_disabled", str(e))
                    return
                except Exception as e:  # noqa: BLE001 - registry/engine refused the adapter
                    logger.exception("loading adapter %s failed", req.adapter_key)
                    yield error_chunk(503, "adapter_load_failed", f"adapter could not be loaded: {e}")
                    return
                self.placement.note_request(req.adapter_key)
                c = self.counters[req.adapter_key]
                if lease.hit:
                    c.hits += 1
                else:
                    c.misses += 1
                    c.load_seconds += lease.load_s
                    self._publish_residency()  # now that the cache lists it
            async for chunk in self._run_engine(req, started_at, lease.hit if lease else None):
                yield chunk
        finally:
            self._ongoing -= 1
            if lease is not None:
                self.adapters.release(lease.key)

    # ------------------------------------------------------------------ prompts: limits before work
    def _limits(self) -> tuple[int, int]:
        """(max_model_len, most characters a prompt can have and still fit it). The character bound is
        cheap and checked before tokenizing: no token decodes to more than `longest` characters, so a
        prompt of more than max_model_len * longest characters cannot fit (x4 for normalizers that merge
        characters)."""
        if self._prompt_limits is None:
            max_len = self.engine.engine.max_model_len
            tok = self.engine.tokenizer
            longest = max((len(t) for t in tok.get_vocab()), default=1) if tok is not None else 1
            self._prompt_limits = (max_len, 4 * max(1, longest) * max_len)
        return self._prompt_limits

    def _tokenize(self, req: GenerateRequest) -> list[list[int]]:
        """Each prompt's token ids; run off the event loop. Raises _Refused before any tokenizing when a
        prompt's length alone shows it cannot fit."""
        max_len, max_chars = self._limits()
        tok = self.engine.tokenizer

        def check_chars(n: int) -> None:
            if n > max_chars:
                raise _Refused("context_length_exceeded", f"the prompt has {n} characters: more than this "
                               f"model's maximum context length of {max_len} tokens can hold", "messages")

        if req.messages is not None:
            check_chars(sum(len(m.get("content") or "") for m in req.messages))
            ids = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # transformers may return a BatchEncoding
                ids = ids["input_ids"]
            return [[int(t) for t in ids]]
        out = []
        for prompt in req.inputs():
            if isinstance(prompt, str):
                if tok is None:
                    raise _Refused("invalid_request", "this model has no tokenizer: send token ids", "prompt")
                check_chars(len(prompt))
                out.append([int(t) for t in tok(prompt)["input_ids"]])
            else:
                out.append([int(t) for t in prompt])
        return out

    def _params(self, req: GenerateRequest, prompt_len: int, sample: int):
        """SamplingParams of one choice; max_tokens beyond the remaining context is a 400 (like vLLM's) when the
        client asked for it, and cut to the room left when it is the default."""
        from engine_ext import SamplingParams

        max_len, _ = self._limits()
        sampling = dict(req.sampling)
        wanted = int(sampling["max_tokens"])
        room = max_len - prompt_len
        if room < 1 or (wanted > room and req.max_tokens_explicit):
            raise _Refused("context_length_exceeded",
                           f"This model's maximum context length is {max_len} tokens. However, you requested "
                           f"{prompt_len + wanted} tokens ({prompt_len} in the messages, {wanted} in the "
                           f"completion). Please reduce the length of the messages or completion.",
                           "max_tokens" if room >= 1 else "messages")
        sampling["max_tokens"] = min(wanted, room)
        if sampling.get("seed") is not None and sample:  # n > 1: distinct, reproducible samples
            sampling["seed"] = (sampling["seed"] + sample) % 2**64
        return SamplingParams(**sampling)

    def _logprob_entries(self, out) -> Optional[list]:
        if out.new_logprobs is None:
            return None
        tok = self.engine.tokenizer
        text = (lambda t: tok.decode([t])) if tok is not None else str  # noqa: E731
        clamp = lambda v: max(v, -9999.0)  # noqa: E731 - JSON has no -inf
        return [[text(e.token_id), clamp(e.logprob), [[text(t), clamp(v)] for t, v in e.top]]
                for e in out.new_logprobs]

    # ------------------------------------------------------------------ generation
    async def _run_engine(self, req: GenerateRequest, started_at: float, hit: Optional[bool]) -> AsyncIterator[dict]:
        try:
            prompts = await asyncio.to_thread(self._tokenize, req)
            choices = [(ids, self._params(req, len(ids), j)) for ids in prompts for j in range(req.n)]
        except _Refused as e:
            yield error_chunk(400, e.code, str(e), e.param)
            return
        except Exception as e:  # noqa: BLE001 - a template or parameter the engine cannot take
            yield error_chunk(400, "invalid_request", str(e))
            return
        rid = req.request_id
        ids_of = (lambda i: rid) if len(choices) == 1 else (lambda i: f"{rid}/{i}")  # noqa: E731
        # The n samples of one prompt are consecutive choices: each after the first reuses the first's prompt KV.
        streams = [self.engine.generate(None, prompt_token_ids=ids, sampling_params=params, adapter_name=req.adapter_key,
                                        request_id=ids_of(i), share_prompt_with=ids_of(i - i % req.n) if i % req.n
                                        else None)
                   for i, (ids, params) in enumerate(choices)]
        firsts = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
        failed = next((e for e in firsts if isinstance(e, BaseException)), None)
        if failed is not None:
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
            if not isinstance(failed, ValueError):
                raise failed
            too_long = "max_model_len" in str(failed) or "KV blocks" in str(failed)
            yield error_chunk(400, "context_length_exceeded" if too_long else "invalid_request", str(failed))
            return
        yield {"type": "start", "replica": self.replica_id, "adapter_hit": hit, "started_at": started_at,
               "prompt_tokens": sum(len(ids) for ids in prompts), "num_running": self._stats.get("num_running")}
        finish, tokens = {}, {}
        merged = _merge(streams, firsts)
        try:
            async for i, out in merged:
                if out.new_token_ids or out.delta_text:
                    yield {"type": "delta", "index": i, "text": out.delta_text, "num_tokens": len(out.new_token_ids),
                           "logprobs": self._logprob_entries(out)}
                if out.finished:
                    finish[i], tokens[i] = out.finish_reason or "stop", len(out.token_ids)
        finally:
            await merged.aclose()  # the caller went away: abort every unfinished choice now
        yield {"type": "end", "finish_reason": finish[0], "completion_tokens": sum(tokens.values()),
               "finish_reasons": finish, "choice_tokens": tokens, "prompt_tokens": sum(len(ids) for ids in prompts),
               "snapshot": self.snapshot(req.adapter_key)}

    # ------------------------------------------------------------------ reporting
    def snapshot(self, key: Optional[str]) -> dict[str, Any]:
        """Replica gauges, the speculation's counters and this adapter's counters: what a response's last chunk
        carries to the ingress's /metrics."""
        return self._report([key] if key is not None else [])

    def report(self) -> dict[str, Any]:
        """`snapshot` of every adapter the replica has counters for: what it sends on a timer."""
        return self._report(sorted(set(self.counters) | set(self._stats.get("adapters") or {})))

    def _report(self, keys: list[str]) -> dict[str, Any]:
        s = self._stats
        out: dict[str, Any] = {k: s.get(k) for k in ("num_running", "num_waiting", "free_kv_blocks")}
        out["seq"] = self._stats_seq
        out["device_adapters"] = len(s.get("device_adapters", ()))
        out["host_adapters"] = len(self.adapters.known())
        spec = s.get("speculative")
        if spec is not None:
            out["speculative"] = {"cycles": spec["cycles"], "plain_steps": spec["plain_steps"],
                                  "joined": spec.get("joined"), "ridden_prompts": spec.get("ridden_prompts"),
                                  "paced_prompts": spec.get("paced_prompts"),
                                  "gate_decisions": dict(spec["gate_decisions"])}
        engine_adapters = s.get("adapters") or {}
        if keys:
            out["adapters"] = {}
        for key in keys:
            c, eng = self.counters[key] if key in self.counters else _AdapterCounters(), engine_adapters.get(key, {})
            out["adapters"][key] = {"hits": c.hits, "misses": c.misses, "loads": c.loads,
                                    "load_seconds": c.load_seconds,
                                    **{k: eng.get(k) for k in ("tokens", "acceptance_rate", "drafted_tokens",
                                                               "accepted_tokens")}}
        return out

    def record_routing_stats(self) -> dict[str, Any]:
        """What `router.AffinityRouter` ranks on (Serve polls this every routing_stats_period_s)."""
        s = self._stats
        known = self.adapters.known()
        known_set = set(known)
        return {
            "device_adapters": [a for a in s.get("device_adapters", ()) if a in known_set],
            "host_adapters": known,
            "num_running": s.get("num_running"),
            "num_waiting": s.get("num_waiting"),
            "free_kv_blocks": s.get("free_kv_blocks"),
            "num_ongoing": self._ongoing,
            "disabled": self.adapters.blocked(),
            "reported_at": self._clock(),
            # families the placement homed here in host memory (pinned, warm); None: no controller
            "homes": None if self._placement_sync is None else self.placement.homes(),
            "placement_version": self.placement.share["version"],
            "pinned": sorted(self.placement.pinned),
        }
