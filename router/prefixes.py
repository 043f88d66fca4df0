"""Prefix affinity: which replica most recently served a request with the same prompt prefix for the same adapter
version, so the router can send the next one where that prefix's KV is likely still cached (the engine caches
prompt KV per adapter version: engine_ext/prefix_cache.py).

`prefix_fingerprint` is the ingress's cheap stand-in for the engine's block hashes, computed before tokenizing:
a hash of the prompt's first `PREFIX_CHARS` characters (a chat's system prompt and first turns), or of its first
`PREFIX_IDS` token ids; prompts shorter than that have no fingerprint (too little to be worth steering).
`PrefixMemory` is the router's memory of (adapter key, fingerprint) -> replica -> when it last sent one there;
entries older than `ttl_s` are forgotten (the replica has likely evicted those blocks), and it holds at most
`max_entries` fingerprints, least recently used out first.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

__all__ = ["PREFIX_CHARS", "PREFIX_IDS", "prefix_fingerprint", "PrefixMemory"]

PREFIX_CHARS = 512  # about 128 tokens of English: the first 8 KV blocks of 16
PREFIX_IDS = 128

Prompt = Union[str, list[int], list[dict[str, str]]]


def prefix_fingerprint(prompt: Prompt) -> Optional[str]:
    """A short hash of the prompt's head: text, token ids, or chat messages ({role, content}, as sent)."""
    if isinstance(prompt, str):
        head = prompt[:PREFIX_CHARS] if len(prompt) >= PREFIX_CHARS else None
        data = None if head is None else head.encode()
    elif prompt and isinstance(prompt[0], dict):
        text = json.dumps([[m.get("role"), m.get("content")] for m in prompt], ensure_ascii=False)
        data = text[:PREFIX_CHARS].encode() if len(text) >= PREFIX_CHARS else None
    else:
        data = ",".join(map(str, prompt[:PREFIX_IDS])).encode() if len(prompt) >= PREFIX_IDS else None
    return None if data is None else hashlib.blake2b(data, digest_size=8).hexdigest()


@dataclass
class PrefixMemory:
    ttl_s: float = 60.0
    max_entries: int = 10_000
    clock: Callable[[], float] = time.monotonic
    _seen: OrderedDict[tuple[str, str], dict[str, float]] = field(default_factory=OrderedDict)

    def note(self, adapter: str, fingerprint: str, replica: str) -> None:
        key = (adapter, fingerprint)
        self._seen.setdefault(key, {})[replica] = self.clock()
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)

    def recency(self, adapter: str, fingerprint: Optional[str]) -> dict[str, float]:
        """replica -> when it was last sent this prefix (within ttl_s); {} without a fingerprint."""
        if fingerprint is None:
            return {}
        sent = self._seen.get((adapter, fingerprint))
        if not sent:
            return {}
        now = self.clock()
        return {r: t for r, t in sent.items() if now - t <= self.ttl_s}

    def forget_replica(self, replica: str) -> None:
        for sent in self._seen.values():
            sent.pop(replica, None)
