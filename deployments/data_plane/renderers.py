"""A `ReplicaSession`'s answer as the client asked for it: one OpenAI JSON object, or Server-Sent Events; and the
headers that say which replica served it. Each renderer is given the session and what the body needs to name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from deployments.data_plane import responses as R
from deployments.data_plane.errors import APIError, error_body
from deployments.data_plane.replica_session import ReplicaSession

__all__ = ["Shape", "render_json", "render_sse", "response_headers"]


@dataclass(frozen=True)
class Shape:
    """What the answer looks like: chat or completion, the model as the client named it, logprobs, usage."""

    chat: bool
    model: str
    logprobs: bool = False
    include_usage: bool = False  # streams only: a last chunk with the usage


def _logprobs(shape: Shape, entries: Optional[list], offset: int) -> Optional[dict]:
    if not shape.logprobs:
        return None
    return R.chat_logprobs(entries or []) if shape.chat else R.completion_logprobs(entries or [], offset)


async def render_json(session: ReplicaSession, shape: Shape) -> dict[str, Any]:
    async for _ in session.deltas():  # the text gathers in session.choices (a retry resets it)
        pass
    make_choice = R.chat_choice if shape.chat else R.completion_choice
    choices = [make_choice(i, "".join(c.parts), c.finish_reason or "stop", _logprobs(shape, c.logprobs, 0))
               for i, c in enumerate(session.choices)]
    use = R.usage(session.prompt_tokens, session.completion_tokens)
    return (R.chat_completion if shape.chat else R.completion)(session.req.request_id, shape.model, choices, use)


async def render_sse(session: ReplicaSession, shape: Shape, created: int) -> AsyncIterator[str]:
    rid, model = session.req.request_id, shape.model
    if shape.chat:
        for i in range(len(session.choices)):
            yield R.sse(R.chat_chunk(rid, model, i, {"role": "assistant", "content": ""}, None, created))
    try:
        async for d in session.deltas():
            if not d.text and not d.logprobs:
                continue
            session.sent = True
            if shape.chat:
                yield R.sse(R.chat_chunk(rid, model, d.index, {"content": d.text}, None, created,
                                         _logprobs(shape, d.logprobs, 0)))
            else:
                offset = session.choices[d.index].chars
                yield R.sse(R.completion_chunk(rid, model, d.index, d.text, None, created,
                                               _logprobs(shape, d.logprobs, offset)))
    except APIError as err:
        yield R.sse(error_body(err.status, err.message, err.code))
        yield R.SSE_DONE
        return
    last = None
    for i, c in enumerate(session.choices):
        finish = c.finish_reason or "stop"
        last = (R.chat_chunk(rid, model, i, {}, finish, created) if shape.chat
                else R.completion_chunk(rid, model, i, "", finish, created))
        yield R.sse(last)
    if shape.include_usage:
        yield R.sse({**last, "choices": [], "usage": R.usage(session.prompt_tokens, session.completion_tokens)})
    yield R.SSE_DONE


def response_headers(session: ReplicaSession, request_id_header: bool = True) -> dict[str, str]:
    """Which replica served the request and whether it already held the adapter (benchmarks); `x-request-id`
    unless the request carried one (Serve's proxy echoes that itself)."""
    out = {"x-request-id": session.req.request_id} if request_id_header else {}
    if session.req.adapter_key:
        out["x-loraserve-adapter"] = session.req.adapter_key  # name@version: which canary/version served
    if session.replica:
        out["x-loraserve-replica"] = str(session.replica)
    if session.adapter_hit is not None:
        out["x-loraserve-adapter-hit"] = "1" if session.adapter_hit else "0"
    if session.retries:
        out["x-loraserve-retries"] = str(session.retries)
    return out
