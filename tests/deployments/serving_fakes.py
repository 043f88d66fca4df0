"""Fakes of the ingress's neighbours (registry resolver, LLM replicas) for unit tests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional

from deployments.data_plane.protocol import PromptBound


class NotFound(LookupError):
    pass


class Disabled(Exception):
    pass


@dataclass
class Rec:
    name: str
    version: int
    base_model: str = "tiny"
    owner_tenant: Optional[str] = None
    visibility: str = "public"
    disabled: bool = False


@dataclass
class FakeResolver:
    records: dict[str, Rec] = field(default_factory=dict)

    def resolve(self, name, tenant, request_id=None):
        rec = self.records.get(name)
        if rec is None or (rec.visibility != "public" and rec.owner_tenant != tenant):
            raise NotFound(name)
        if rec.disabled:
            raise Disabled(name)
        return rec

    def list_adapters(self, tenant=None):
        return [r for r in self.records.values() if r.visibility == "public" or r.owner_tenant == tenant]


@dataclass
class FakeLLM:
    """Echoes the prompt's words back as tokens; records requests."""

    seen: list = field(default_factory=list)
    fail_with: Optional[dict] = None
    delay_s: float = 0.0
    load_s: float = 0.0  # before the first chunk, like a replica loading the adapter
    bound: PromptBound = PromptBound(max_model_len=2048, chars_per_token=8)  # what it answers the ingress

    async def prompt_bound(self) -> PromptBound:
        return self.bound

    async def stream(self, req):
        self.seen.append(req)
        if self.load_s:
            await asyncio.sleep(self.load_s)
        if self.fail_with is not None:
            yield self.fail_with
            return
        yield {"type": "start", "replica": "r0", "adapter_hit": True, "started_at": req.submitted_at,
               "prompt_tokens": 3, "num_running": 1}
        inputs = req.inputs() or [req.messages[-1]["content"]]
        texts = [p if isinstance(p, str) else "ids" for p in inputs for _ in range(req.n)]
        words = [t.split()[: req.sampling["max_tokens"]] for t in texts]
        for i, ws in enumerate(words):
            for w in ws:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                yield {"type": "delta", "index": i, "text": w + " ", "num_tokens": 1, "logprobs": None}
        finish = {i: "length" if len(ws) == req.sampling["max_tokens"] else "stop" for i, ws in enumerate(words)}
        yield {"type": "end", "finish_reason": finish[0], "finish_reasons": finish, "prompt_tokens": 3,
               "completion_tokens": sum(len(ws) for ws in words),
               "choice_tokens": {i: len(ws) for i, ws in enumerate(words)},
               "snapshot": {"num_running": 1, "adapters": {req.adapter_key or "-": {"hits": 4, "loads": 1, "acceptance_rate": 0.75,
                                                                       "load_seconds": 0.5}}}}
