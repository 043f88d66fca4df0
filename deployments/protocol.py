"""What the ingress sends an LLM replica, and the chunks a replica streams back.

Chunks are plain dicts (cheap to pickle through Ray), in this order:
  {"type": "start", "replica", "adapter_hit", "load_s", "started_at", "prompt_tokens", "num_running"}
  {"type": "delta", "text", "num_tokens"}                      zero or more
  {"type": "end", "finish_reason", "prompt_tokens", "completion_tokens", "snapshot"}
or at any point {"type": "error", "status", "code", "message"} as the last chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["GenerateRequest", "error_chunk"]


@dataclass
class GenerateRequest:
    request_id: str
    adapter_key: Optional[str]  # "name@version" as resolved by the ingress; None: base model
    sampling: dict[str, Any]  # engine SamplingParams fields
    prompt: Optional[str] = None
    prompt_token_ids: Optional[list[int]] = None
    messages: Optional[list[dict[str, str]]] = None  # chat: the replica applies the chat template
    submitted_at: float = 0.0  # ingress wall clock, for queue time
    labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.prompt, self.prompt_token_ids, self.messages))
        if given != 1:
            raise ValueError("exactly one of prompt, prompt_token_ids, messages")


def error_chunk(status: int, code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "status": status, "code": code, "message": message}
