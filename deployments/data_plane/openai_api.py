"""The OpenAI-compatible data plane as a FastAPI app built from injected parts.

`create_openai_app(IngressDeps(...))` has no Ray in it: the Serve ingress passes an `llm` that calls the replicas
through a deployment handle; unit tests pass a fake. The app is four layers, outermost first:
- the front door (`front_door.FrontDoor`): API key -> the caller's bench (RefusalHold: a caller refused over and
  over) -> the tenant's rate limit, from the headers alone, before a byte of the body is read;
- a prompt Serve's proxy refused as too long for the context (`proxy_guard`), answered without its body;
- the body limit (`errors.BodyLimit`): a body over `max_request_bytes` is a 413 before it is parsed;
- the routes (`openai_routes.OpenAIRoutes`), and one error vocabulary: every error answer is an OpenAI error body,
  counted by status and reason in `/metrics`, and every 4xx answer to a caller counts towards benching it. A
  dependency out of reach (the registry's Redis or S3) is a 503 with Retry-After. Without `metrics_token`,
  /metrics names no tenant and no tenant-private adapter (both labelled "private").
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.data_plane.errors import APIError, BodyLimit
from deployments.data_plane.front_door import FrontDoor, caller_of
from deployments.data_plane.ingress_deps import IngressDeps, KnownBound, Limiter, LLMClient, Resolver
from deployments.data_plane.openai_routes import OpenAIRoutes, unavailable
from deployments.data_plane.proxy_guard import GuardedRefusals
from deployments.dependency_health import DependencyUnavailable

__all__ = ["create_openai_app", "IngressDeps", "KnownBound", "LLMClient", "Resolver", "Limiter"]

logger = logging.getLogger(__name__)


def _validation_error(err: RequestValidationError) -> APIError:
    first = err.errors()[0] if err.errors() else {}
    if first.get("type") == "json_invalid":  # its loc is the offset of the error in the body, not a field
        return APIError(400, f"Invalid request: the body is not valid JSON ({first.get('msg', '')})",
                        code="invalid_request")
    # pydantic adds the union member it tried ("list[...]", "function-after[...]"): not part of the path
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not ("[" in str(x) or "(" in str(x))]
    param = loc[0] if loc else None
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"Unsupported parameter: {'.'.join(loc)!r} is not supported by this server.",
                        code="unsupported_parameter", param=param)
    msg = str(first.get("msg", "malformed body")).removeprefix("Value error, ")
    return APIError(400, f"Invalid request: {'.'.join(loc) or 'body'}: {msg}", code="invalid_request", param=param)


def create_openai_app(deps: IngressDeps) -> FastAPI:
    app = FastAPI(title="loraserve", docs_url=None, redoc_url=None)
    answer = _install_error_answers(app, deps)
    m = deps.metrics

    def too_large(size: int) -> tuple[int, dict]:
        err = APIError(413, f"The request body is larger than this server accepts ({deps.max_request_bytes} "
                       f"bytes).", code="request_too_large")
        m.http_errors.labels("413", err.code).inc()
        return 413, err.body()

    app.add_middleware(BodyLimit, limit=deps.max_request_bytes, refuse=too_large, exempt=deps.upload_prefix)

    def refused_in_proxy(scope) -> None:
        deps.hold.refused(str(caller_of(scope)))
        m.proxy_refused.inc()

    # behind the front door: a prompt the proxy's guard refused, its body dropped, answered without reading one
    app.add_middleware(GuardedRefusals, bound=lambda: deps.prompt_bound.get(deps.llm), max_body=deps.max_request_bytes,
                       answer=answer, refused=refused_in_proxy, publish=deps.publish_guard_limits)
    # added last, so it runs first: the caller is known, benched or charged before the body limit reads a byte
    app.add_middleware(FrontDoor, api_keys=deps.api_keys, limiter=deps.limiter, hold=deps.hold, answer=answer,
                       count_limited=lambda scope: m.rate_limited.labels(scope).inc(),
                       count_held=m.refusals_held.inc)
    app.include_router(OpenAIRoutes(deps).router)
    if deps.admin_app is not None:
        app.mount(deps.admin_prefix, deps.admin_app)
    return app


def _install_error_answers(app: FastAPI, deps: IngressDeps):
    """Every error the app answers as an OpenAI error body, counted in /metrics; a 4xx answer to a caller the front
    door let in counts towards benching it. -> `answer(APIError) -> JSONResponse` (the front door answers with it)."""
    m = deps.metrics

    def answer(err: APIError) -> JSONResponse:
        m.http_errors.labels(str(err.status), err.code or "error").inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    def refused(request: Request, err: APIError) -> JSONResponse:
        caller = caller_of(request.scope)
        if caller is not None and 400 <= err.status < 500:
            deps.hold.refused(str(caller))
        return answer(err)

    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return refused(request, err)

    async def bad_body(request: Request, err: RequestValidationError) -> JSONResponse:
        return refused(request, _validation_error(err))

    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        return refused(request, APIError(err.status_code, str(err.detail), code=code))

    async def dependency(_: Request, err: DependencyUnavailable) -> JSONResponse:
        return answer(unavailable(err))

    async def internal(_: Request, err: Exception) -> JSONResponse:
        logger.exception("unhandled error in the data plane")
        return answer(APIError(500, f"internal error: {type(err).__name__}", code="internal_error"))

    for kind, handler in ((APIError, api_error), (RequestValidationError, bad_body), (StarletteHTTPException, http_error),
                          (DependencyUnavailable, dependency), (Exception, internal)):
        app.add_exception_handler(kind, handler)
    return answer
