"""OpenAI response objects (completion, chat completion, their stream chunks, logprobs, models)."""

from __future__ import annotations

import json
import time
from typing import Any, Optional

__all__ = ["completion", "chat_completion", "completion_choice", "chat_choice", "completion_chunk", "chat_chunk",
           "chat_logprobs", "completion_logprobs", "usage", "sse", "SSE_DONE", "model_list", "model_object"]

SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(kind: str, rid: str, model: str, choices: list, created: Optional[int] = None) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": created or int(time.time()), "model": model, "choices": choices}


# Logprob entries as replicas send them (deployments.data_plane.protocol): [token text, logprob, [[text, logprob], ...]].
def chat_logprobs(entries: list) -> dict[str, Any]:
    def item(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}

    return {"content": [{**item(t, lp), "top_logprobs": [item(a, alp) for a, alp in top]} for t, lp, top in entries],
            "refusal": None}


def completion_logprobs(entries: list, offset: int) -> dict[str, Any]:
    """`offset`: characters of the choice's text before the first entry's token."""
    offsets = []
    for text, _, _ in entries:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{a: alp for a, alp in top} for _, _, top in entries], "text_offset": offsets}


def completion_choice(index: int, text: str, finish: Optional[str], logprobs: Optional[dict] = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def chat_choice(index: int, text: str, finish: Optional[str], logprobs: Optional[dict] = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
            "logprobs": logprobs}


def completion(rid: str, model: str, choices: list[dict], use: dict) -> dict[str, Any]:
    return {**_envelope("text_completion", rid, model, choices), "usage": use}


def chat_completion(rid: str, model: str, choices: list[dict], use: dict) -> dict[str, Any]:
    return {**_envelope("chat.completion", rid, model, choices), "usage": use}


def completion_chunk(rid: str, model: str, index: int, text: str, finish: Optional[str], created: int,
                     logprobs: Optional[dict] = None) -> dict[str, Any]:
    return _envelope("text_completion", rid, model, [completion_choice(index, text, finish, logprobs)], created)


def chat_chunk(rid: str, model: str, index: int, delta: dict, finish: Optional[str], created: int,
               logprobs: Optional[dict] = None) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    return _envelope("chat.completion.chunk", rid, model, [choice], created)


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def model_object(name: str, base: str, owner: Optional[str], created: int) -> dict[str, Any]:
    """`owner`: the owning tenant, None for public; the base model itself when name == base."""
    if name == base:
        return {"id": base, "object": "model", "created": created, "owned_by": "loraserve", "root": base,
                "parent": None}
    return {"id": name, "object": "model", "created": created, "owned_by": owner or "public", "root": base,
            "parent": base}


def model_list(base: str, adapters: list[tuple[str, Optional[str]]], created: int) -> dict[str, Any]:
    """`adapters`: (name, owner tenant or None for public)."""
    data = [model_object(base, base, None, created)]
    data += [model_object(name, base, owner, created) for name, owner in sorted(adapters)]
    return {"object": "list", "data": data}
