"""OpenAI response objects (completion, chat completion, their stream chunks, model list)."""

from __future__ import annotations

import json
import time
from typing import Any, Optional

__all__ = ["completion", "chat_completion", "completion_chunk", "chat_chunk", "usage", "sse", "SSE_DONE", "model_list"]

SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(kind: str, rid: str, model: str, choices: list, created: Optional[int] = None) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": created or int(time.time()), "model": model, "choices": choices}


def completion(rid: str, model: str, text: str, finish: str, use: dict) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {**_envelope("text_completion", rid, model, [choice]), "usage": use}


def chat_completion(rid: str, model: str, text: str, finish: str, use: dict) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}
    return {**_envelope("chat.completion", rid, model, [choice]), "usage": use}


def completion_chunk(rid: str, model: str, text: str, finish: Optional[str], created: int) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return _envelope("text_completion", rid, model, [choice], created)


def chat_chunk(rid: str, model: str, delta: dict, finish: Optional[str], created: int) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    return _envelope("chat.completion.chunk", rid, model, [choice], created)


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def model_list(base: str, adapters: list[tuple[str, Optional[str]]], created: int) -> dict[str, Any]:
    """`adapters`: (name, owner tenant or None for public)."""
    data = [{"id": base, "object": "model", "created": created, "owned_by": "loraserve", "root": base, "parent": None}]
    for name, owner in sorted(adapters):
        data.append(
            {"id": name, "object": "model", "created": created, "owned_by": owner or "public", "root": base,
             "parent": base}
        )
    return {"object": "list", "data": data}
