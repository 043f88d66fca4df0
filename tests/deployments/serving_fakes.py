"""Fakes of the ingress's neighbours (registry resolver, LLM replicas) for unit tests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional


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

    async def stream(self, req):
        self.seen.append(req)
        if self.load_s:
            await asyncio.sleep(self.load_s)
        if self.fail_with is not None:
            yield self.fail_with
            return
        yield {"type": "start", "replica": "r0", "adapter_hit": True, "started_at": req.submitted_at,
               "prompt_tokens": 3, "num_running": 1}
        text = req.prompt if req.prompt is not None else (req.messages[-1]["content"] if req.messages else "ids")
        words = text.split()[: req.sampling["max_tokens"]]
        for w in words:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            yield {"type": "delta", "text": w + " ", "num_tokens": 1}
        finish = "length" if len(words) == req.sampling["max_tokens"] else "stop"
        yield {"type": "end", "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": len(words),
               "snapshot": {"num_running": 1, "adapters": {req.adapter_key or "-": {"hits": 4, "loads": 1, "acceptance_rate": 0.75,
                                                                       "load_seconds": 0.5}}}}
