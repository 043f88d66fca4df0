"""OpenAI-format errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from fastapi.responses import JSONResponse

__all__ = ["APIError", "error_body", "error_response", "status_type"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


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
