"""OpenAI-format errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from fastapi.responses import JSONResponse

__all__ = ["APIError", "BodyLimit", "chunk_error", "error_body", "error_response", "retry_after", "status_type"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    405: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


def retry_after(seconds: float) -> str:
    """A Retry-After header's value: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(seconds)))


def status_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


class APIError(Exception):
    """Raised anywhere in the data plane; rendered by one exception handler."""

    def __init__(
        self,
        status: int,
        message: str,
        code: Optional[str] = None,
        param: Optional[str] = None,
        headers: Optional[Mapping[str, str]] = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(status: int, message: str, code: Optional[str] = None, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": status_type(status), "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def chunk_error(chunk: Mapping[str, Any]) -> APIError:
    """A replica's error chunk (deployments.data_plane.protocol) as the HTTP error it stands for (a 503 says when
    to retry)."""
    retry = chunk.get("retry_after_s")
    headers = {"Retry-After": retry_after(retry)} if retry is not None else None
    return APIError(chunk["status"], chunk["message"], code=chunk["code"], param=chunk.get("param"), headers=headers)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets `refuse(size)` -> (status, JSON body) before it
    is parsed. A declared Content-Length over the limit is refused without reading a byte; a body without one
    (chunked) is counted as it arrives and cut off at the limit. Paths under `exempt` (the control plane's
    uploads, which stream to disk under a limit of their own) pass as they are."""

    def __init__(self, app, limit: int, refuse, exempt: Optional[str] = None):
        self.app, self.limit, self.refuse, self.exempt = app, limit, refuse, exempt

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or (self.exempt and scope.get("path", "").startswith(self.exempt)):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self._answer(send, int(declared) if declared.isdigit() else -1)
        seen, over, started = 0, False, False

        async def counted_receive():
            nonlocal seen, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # the app sees a client that went away; we answer below
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                if over:
                    return  # the app's answer to the disconnect; ours follows
                started = True
            elif over and not started:
                return
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except Exception:
            if not over:
                raise
        if over and not started:
            await self._answer(send, seen)

    async def _answer(self, send, size: int) -> None:
        import json

        status, body = self.refuse(size)
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})
