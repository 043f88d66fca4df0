"""The OpenAI-compatible data plane as a FastAPI app built from injected parts.

`create_openai_app(IngressDeps(...))` has no Ray in it: the Serve ingress passes an `llm`
that calls the replicas through a deployment handle; unit tests pass a fake.
Order of checks per request: API key -> body -> model name -> registry (visibility,
disabled, canary pick) -> rate limits -> cold-load gate -> replica.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Mapping, Optional, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments import responses as R
from deployments.adapter_cache import adapter_key
from deployments.errors import APIError, error_body, error_response
from deployments.metrics import CONTENT_TYPE, ServingMetrics
from deployments.openai_schema import ChatCompletionRequest, CompletionRequest, parse_model
from deployments.protocol import GenerateRequest
from deployments.rate_limit import ColdLoadGate, RateLimited, RateLimiter
from deployments.stream import StreamRun

__all__ = ["create_openai_app", "IngressDeps", "LLMClient", "Resolver"]


class Resolver(Protocol):
    def resolve(self, name: str, tenant: Optional[str], request_id: Optional[str] = None) -> Any: ...
    def list_adapters(self, tenant: Optional[str] = None) -> list: ...


class LLMClient(Protocol):
    def stream(self, req: GenerateRequest) -> AsyncIterator[dict]: ...


@dataclass
class IngressDeps:
    base_name: str
    api_keys: Mapping[str, str]  # key -> tenant
    resolver: Resolver
    llm: LLMClient
    limiter: RateLimiter
    gate: ColdLoadGate
    metrics: ServingMetrics = field(default_factory=ServingMetrics)
    max_tokens_limit: int = 4096
    default_completion_tokens: int = 16  # OpenAI's default for /v1/completions
    default_chat_tokens: int = 256
    admin_app: Any = None
    admin_prefix: str = "/admin"
    registry_errors: tuple = ()  # (not_found_cls, disabled_cls): registry exception classes
    clock: Callable[[], float] = time.time


def _tenant(deps: IngressDeps, request: Request) -> str:
    auth = request.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    tenant = deps.api_keys.get(key.strip()) if scheme.lower() == "bearer" else None
    if tenant is None:
        raise APIError(401, "Incorrect or missing API key.", code="invalid_api_key")
    return tenant


def _resolve(deps: IngressDeps, model: str, tenant: str, request_id: str) -> tuple[Optional[str], str]:
    """`model` -> (adapter key or None for the base, adapter name for limits/metrics)."""
    try:
        ref = parse_model(model, deps.base_name)
    except ValueError as e:
        raise APIError(404, str(e), code="model_not_found", param="model") from None
    if ref.base is not None and ref.base != deps.base_name:
        raise APIError(404, f"The model {model!r} does not exist.", code="model_not_found", param="model")
    if ref.adapter is None:
        return None, "-"
    not_found, disabled = deps.registry_errors
    try:
        rec = deps.resolver.resolve(ref.adapter, tenant, request_id=request_id)
    except not_found:
        raise APIError(404, f"The model {model!r} does not exist or you do not have access to it.",
                       code="model_not_found", param="model") from None
    except disabled:
        raise APIError(403, f"The model {model!r} is disabled.", code="model_disabled", param="model") from None
    if rec.base_model != deps.base_name:
        raise APIError(404, f"The model {model!r} is not served on base {deps.base_name!r}.",
                       code="model_not_found", param="model")
    return adapter_key(rec.name, rec.version), rec.name


def _sampling(body: Any, default_tokens: int, limit: int) -> dict[str, Any]:
    max_tokens = body.wanted_tokens(default_tokens)
    if max_tokens > limit:
        raise APIError(400, f"max_tokens must be <= {limit}", code="invalid_value", param="max_tokens")
    return {"max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "seed": body.seed, "stop": list(body.stop)}


def create_openai_app(deps: IngressDeps) -> FastAPI:
    app = FastAPI(title="loraserve", docs_url=None, redoc_url=None)
    m = deps.metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = f"Invalid request: {'.'.join(loc) or 'body'}: {first.get('msg', 'malformed body')}"
        return JSONResponse(error_body(400, msg, "invalid_request", ".".join(loc) or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if err.status_code == 404 else "http_error"
        return JSONResponse(error_body(err.status_code, str(err.detail), code), status_code=err.status_code)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(m.render(), media_type=CONTENT_TYPE)

    def authenticated(request: Request) -> str:
        # A dependency, so FastAPI runs it before validating the body: a bad key is 401 first.
        return _tenant(deps, request)

    # The resolver's listing is a snapshot that stays the same object until the registry changes, so the rendered
    # body is kept per tenant and re-rendered only after a change: O(1) per request at any number of adapters.
    rendered: dict[str, tuple[Any, bytes]] = {}

    @app.get("/v1/models")
    async def models(tenant: str = Depends(authenticated)) -> Response:
        records = await run_in_threadpool(deps.resolver.list_adapters, tenant)
        cached = rendered.get(tenant)
        if cached is None or cached[0] is not records:
            adapters = {(r.name, None if r.visibility == "public" else r.owner_tenant)
                        for r in records if r.base_model == deps.base_name}
            body = JSONResponse(R.model_list(deps.base_name, sorted(adapters), int(deps.clock()))).body
            cached = rendered[tenant] = (records, body)
        return Response(cached[1], media_type="application/json")

    async def _run(tenant: str, body: Any, chat: bool) -> Response:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        adapter_name = "-"
        try:
            key, adapter_name = await run_in_threadpool(_resolve, deps, body.model, tenant, rid)
            sampling = _sampling(body, deps.default_chat_tokens if chat else deps.default_completion_tokens,
                                 deps.max_tokens_limit)
            try:
                deps.limiter.check(tenant, None if key is None else adapter_name)
            except RateLimited as e:
                m.rate_limited.labels(e.scope).inc()
                raise APIError(429, str(e), code="rate_limit_exceeded",
                               headers={"Retry-After": RateLimiter.retry_after_header(e)}) from None
            if chat:
                try:
                    messages = [{"role": msg.role, "content": msg.text()} for msg in body.messages]
                except ValueError as e:
                    raise APIError(400, str(e), code="invalid_request", param="messages") from None
                req = GenerateRequest(rid, key, sampling, messages=messages, submitted_at=deps.clock())
            elif isinstance(body.prompt, list):
                req = GenerateRequest(rid, key, sampling, prompt_token_ids=list(body.prompt), submitted_at=deps.clock())
            else:
                req = GenerateRequest(rid, key, sampling, prompt=body.prompt, submitted_at=deps.clock())
            run = StreamRun(deps, req, tenant, adapter_name, chat, body.model,
                            include_usage=bool(body.stream_options and body.stream_options.include_usage))
            await run.begin()  # errors before the first token still become plain HTTP errors
        except APIError as err:
            m.requests.labels(adapter_name, tenant, str(err.status)).inc()
            m.errors.labels(adapter_name, tenant, err.code or "error").inc()
            raise
        if body.stream:
            return StreamingResponse(run.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **run.headers()})
        return JSONResponse(await run.collect(), headers=run.headers())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, tenant: str = Depends(authenticated)) -> Response:
        return await _run(tenant, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, tenant: str = Depends(authenticated)) -> Response:
        return await _run(tenant, body, chat=True)

    if deps.admin_app is not None:
        app.mount(deps.admin_prefix, deps.admin_app)
    return app
