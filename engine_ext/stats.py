"""The engine's counters, in one object: what `LLMEngine.stats()` reports and exporters read.

Components update the parts they own (the adapter manager and scheduler an adapter's loads and hits, the
engine requests and tokens, the speculation gate and cycle the speculative counters); `snapshot()` turns
the whole into the plain dict `stats()` returns."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class UsageStats:
    requests: int = 0
    tokens: int = 0  # generated tokens


@dataclass
class AdapterStats(UsageStats):
    loads: int = 0  # copies into a device slot
    hits: int = 0  # requests that found the adapter already in a slot
    disk_loads: int = 0  # parses of its files into host memory (the first, and again after an eviction)
    disk_load_seconds: float = 0.0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rejections: int = 0  # verify passes that rejected one of its drafts
    verifies: int = 0  # verify passes over drafts of its sequences

    def observe_verify(self, drafted: int, accepted: int) -> None:
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.rejections += accepted < drafted
        self.verifies += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over judged drafts: drafts after the first rejection of a cycle are never judged."""
        judged = self.accepted_tokens + self.rejections
        return self.accepted_tokens / judged if judged else None

    def speculative(self) -> dict:
        d, a, v = self.drafted_tokens, self.accepted_tokens, self.verifies
        return {"drafted_tokens": d, "accepted_tokens": a, "acceptance_rate": self.acceptance_rate,
                "draft_efficiency": a / d if d else None, "mean_accepted_length": a / v if v else None,
                "verifies": v}


@dataclass
class SpecStats:
    num_draft_tokens: int
    cycles: int = 0
    plain_steps: int = 0
    draft_passes: int = 0
    cycle_passes: Counter[int] = field(default_factory=Counter)  # cycles by their number of drafting passes
    gate_decisions: Counter[str] = field(default_factory=Counter)
    joined: int = 0  # requests that arrived during a cycle and joined it
    ridden_prompts: int = 0  # prompts computed in a drafting pass (their first token published before the verify)
    paced_prompts: int = 0  # prompts that waited for a later pass (or step) with room in the largest CUDA graph

    def snapshot(self) -> dict:
        return {"cycles": self.cycles, "plain_steps": self.plain_steps,
                "draft_passes": self.draft_passes, "cycle_passes": dict(sorted(self.cycle_passes.items())),
                "joined": self.joined, "ridden_prompts": self.ridden_prompts,
                "paced_prompts": self.paced_prompts,
                "gate_decisions": dict(self.gate_decisions), "num_draft_tokens": self.num_draft_tokens}


@dataclass
class PrefixLookups:
    queries: int = 0  # tokens of the sequences admitted with a cache lookup
    hits: int = 0  # of those, tokens whose KV came from the cache

    def snapshot(self) -> dict:
        return {"queries": self.queries, "hits": self.hits,
                "hit_rate": self.hits / self.queries if self.queries else None}


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups at admission, in tokens: in all, on the base model alone, and per adapter."""

    total: PrefixLookups = field(default_factory=PrefixLookups)
    base: PrefixLookups = field(default_factory=PrefixLookups)
    adapters: dict[str, PrefixLookups] = field(default_factory=dict)

    def observe(self, adapter: str | None, queries: int, hits: int) -> None:
        if adapter is None:
            part = self.base
        else:
            part = self.adapters.get(adapter) or self.adapters.setdefault(adapter, PrefixLookups())
        for p in (self.total, part):
            p.queries += queries
            p.hits += hits

    def snapshot(self) -> dict:
        return self.total.snapshot() | {"base": self.base.snapshot(),
                                        "adapters": {a: p.snapshot() for a, p in list(self.adapters.items())}}


@dataclass
class EngineStats:
    base: UsageStats = field(default_factory=UsageStats)  # requests on the base model alone
    adapters: dict[str, AdapterStats] = field(default_factory=dict)
    spec: SpecStats | None = None  # None: speculation off
    prefix_cache: PrefixCacheStats | None = None  # None: prefix caching off
    steps: int = 0
    device_wait_s: float = 0.0  # host time spent waiting for the device to finish a step it reads

    def adapter(self, name: str) -> AdapterStats:
        stats = self.adapters.get(name)
        if stats is None:
            stats = self.adapters[name] = AdapterStats()
        return stats

    def usage(self, adapter: str | None) -> UsageStats:
        return self.base if adapter is None else self.adapter(adapter)

    def snapshot(self, acceptance_estimates: dict[str, float] | None = None) -> dict:
        """Counters as plain data. `acceptance_estimates`: the gate's running estimate per adapter."""
        adapters = {}
        for name, a in list(self.adapters.items()):
            entry = {k: getattr(a, k) for k in ("requests", "tokens", "loads", "hits", "disk_loads",
                                                "disk_load_seconds")}
            if self.spec is not None:
                entry |= a.speculative() | {"acceptance_ema": (acceptance_estimates or {}).get(name)}
            adapters[name] = entry
        out = {"num_steps": self.steps, "device_wait_s": self.device_wait_s,
               "base": {"requests": self.base.requests, "tokens": self.base.tokens},
               "adapters": adapters}
        if self.spec is not None:
            out["speculative"] = self.spec.snapshot()
        if self.prefix_cache is not None:
            out["prefix_cache"] = self.prefix_cache.snapshot()
        return out
