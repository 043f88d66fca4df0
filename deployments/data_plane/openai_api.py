"""The OpenAI-compatible data plane as a FastAPI app built from injected parts.

`create_openai_app(IngressDeps(...))` has no Ray in it: the Serve ingress passes an `llm`
that calls the replicas through a deployment handle; unit tests pass a fake.
Order of checks per request: body size -> API key -> the tenant's bench (RefusalHold: a caller refused over
and over) -> the tenant's rate limit -> body -> model name -> registry (visibility, disabled, canary pick) ->
the adapter's rate limit -> cold-load gate -> replica, so a request refused for its body has cost its tenant a
token like any other, and every 4xx answer to a tenant counts towards benching it. Every error answer is an OpenAI
error body and is counted by status and reason in `/metrics`; a dependency out of reach (the registry's
Redis or S3) is a 503 with Retry-After. Without `metrics_token`, /metrics names no tenant and no
tenant-private adapter (both labelled "private").
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Mapping, Optional, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.data_plane import responses as R
from deployments.dependency_health import DependencyUnavailable
from deployments.data_plane.errors import APIError, BodyLimit, retry_after
from deployments.metrics import CONTENT_TYPE, ServingMetrics
from deployments.data_plane.openai_schema import ChatCompletionRequest, CompletionRequest, parse_model
from deployments.data_plane.protocol import GenerateRequest
from deployments.data_plane.rate_limit import ColdLoadGate, RateLimited, RateLimiter, RefusalHold
from deployments.data_plane.stream import StreamRun
from registry.api_docs import api_docs_page
from router.keys import AdapterKey

__all__ = ["create_openai_app", "IngressDeps", "LLMClient", "Resolver", "Limiter"]

logger = logging.getLogger(__name__)
PRIVATE = "private"  # the adapter label of tenant-private adapters in an open /metrics


class Resolver(Protocol):
    def resolve(self, name: str, tenant: Optional[str], request_id: Optional[str] = None) -> Any: ...
    def list_adapters(self, tenant: Optional[str] = None) -> list: ...


class LLMClient(Protocol):
    def stream(self, req: GenerateRequest) -> AsyncIterator[dict]: ...


class Limiter(Protocol):
    blocking: bool  # take() waits on I/O (it is called from a worker thread then)

    def take(self, scope: str, key: str) -> None: ...  # scope "tenant" or "adapter"; raises RateLimited


@dataclass
class IngressDeps:
    base_name: str
    api_keys: Mapping[str, str]  # key -> tenant
    resolver: Resolver
    llm: LLMClient
    limiter: Limiter
    gate: ColdLoadGate
    # a caller refused over and over is benched, its answers held (its flood slowed), at most so many at a time
    hold: RefusalHold = field(default_factory=RefusalHold)
    metrics: ServingMetrics = field(default_factory=ServingMetrics)
    max_tokens_limit: int = 4096
    default_completion_tokens: int = 16  # OpenAI's default for /v1/completions
    default_chat_tokens: int = 256
    max_request_bytes: int = 2 * 2**20  # larger bodies get a 413 before they are read
    metrics_token: Optional[str] = None  # None: /metrics is open and shows no tenant-private adapter names
    retries: int = 3  # a request whose replica fails before the client saw a token is retried this often
    retry_backoff_s: float = 0.2
    admin_app: Any = None
    admin_prefix: str = "/admin"
    registry_errors: tuple = ()  # (not_found_cls, disabled_cls): registry exception classes
    # -> dependency -> up (the registry's stores): `/ready` answers 503 while one is down; None: always ready
    readiness: Optional[Callable[[], Mapping[str, bool]]] = None
    upload_prefix: Optional[str] = None  # uploads under this path have the control plane's own size limit
    clock: Callable[[], float] = time.time


@dataclass(frozen=True)
class _Model:
    key: Optional[str]  # adapter key (name@version); None: the base model
    name: str  # adapter name, "-" for the base
    private: bool
    record: Any = None  # the registry's record of the version (the replica loads its files from it)


def _tenant(deps: IngressDeps, request: Request) -> str:
    auth = request.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    tenant = deps.api_keys.get(key.strip()) if scheme.lower() == "bearer" else None
    if tenant is None:
        raise APIError(401, "Incorrect or missing API key.", code="invalid_api_key")
    return tenant


async def _take(deps: IngressDeps, scope: str, key: str) -> None:
    """One token of `key`'s bucket in `scope`, or a 429."""
    try:
        if deps.limiter.blocking:
            await run_in_threadpool(deps.limiter.take, scope, key)
        else:
            deps.limiter.take(scope, key)
    except RateLimited as e:
        deps.metrics.rate_limited.labels(e.scope).inc()
        raise APIError(429, str(e), code="rate_limit_exceeded",
                       headers={"Retry-After": RateLimiter.retry_after_header(e)}) from None


async def _unbenched(deps: IngressDeps, tenant: str) -> None:
    """A 429 for a benched `tenant` (RefusalHold), its answer held, else nothing."""
    if not deps.hold.benched(tenant):
        return
    deps.metrics.rate_limited.labels("refusals").inc()
    if await deps.hold.hold():
        deps.metrics.refusals_held.inc()
    wait = deps.hold.retry_after_s(tenant)
    raise APIError(429, f"too many refused requests from tenant {tenant!r}; retry after {wait:.2f}s",
                   code="rate_limit_exceeded", headers={"Retry-After": retry_after(wait)})


def _unavailable(err: DependencyUnavailable) -> APIError:
    return APIError(503, str(err), code="service_unavailable",
                    headers={"Retry-After": retry_after(err.retry_after_s)})


def _resolve(deps: IngressDeps, model: str, tenant: str, request_id: str) -> _Model:
    try:
        ref = parse_model(model, deps.base_name)
    except ValueError as e:
        raise APIError(404, str(e), code="model_not_found", param="model") from None
    if ref.base is not None and ref.base != deps.base_name:
        raise APIError(404, f"The model {model!r} does not exist.", code="model_not_found", param="model")
    if ref.adapter is None:
        return _Model(None, "-", False)
    not_found, disabled = deps.registry_errors
    try:
        rec = deps.resolver.resolve(ref.adapter, tenant, request_id=request_id)
    except DependencyUnavailable as e:
        raise _unavailable(e) from None
    except not_found:
        raise APIError(404, f"The model {model!r} does not exist or you do not have access to it.",
                       code="model_not_found", param="model") from None
    except disabled:
        raise APIError(403, f"The model {model!r} is disabled.", code="model_disabled", param="model") from None
    if rec.base_model != deps.base_name:
        raise APIError(404, f"The model {model!r} is not served on base {deps.base_name!r}.",
                       code="model_not_found", param="model")
    return _Model(str(AdapterKey(rec.name, rec.version)), rec.name, rec.visibility != "public", rec)


def _sampling(body: Any, default_tokens: int, limit: int) -> tuple[dict[str, Any], bool]:
    max_tokens, explicit = body.wanted_tokens(default_tokens)
    if max_tokens > limit:
        raise APIError(400, f"max_tokens must be <= {limit}", code="invalid_value", param="max_tokens")
    return {"max_tokens": max_tokens, **body.engine_sampling()}, explicit


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
    m = deps.metrics

    def answer(err: APIError) -> JSONResponse:
        m.http_errors.labels(str(err.status), err.code or "error").inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    def refused(request: Request, err: APIError) -> JSONResponse:
        # a 4xx answer to an authenticated caller counts towards benching it (RefusalHold)
        tenant = getattr(request.state, "tenant", None)
        if tenant is not None and 400 <= err.status < 500:
            deps.hold.refused(tenant)
        return answer(err)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return refused(request, err)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, err: RequestValidationError) -> JSONResponse:
        return refused(request, _validation_error(err))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        return answer(APIError(err.status_code, str(err.detail), code=code))

    @app.exception_handler(DependencyUnavailable)
    async def _dependency(_: Request, err: DependencyUnavailable) -> JSONResponse:
        return answer(_unavailable(err))

    @app.exception_handler(Exception)
    async def _internal(_: Request, err: Exception) -> JSONResponse:
        logger.exception("unhandled error in the data plane")
        return answer(APIError(500, f"internal error: {type(err).__name__}", code="internal_error"))

    def too_large(size: int) -> tuple[int, dict]:
        err = APIError(413, f"The request body is larger than this server accepts ({deps.max_request_bytes} "
                       f"bytes).", code="request_too_large")
        m.http_errors.labels("413", err.code).inc()
        return 413, err.body()

    app.add_middleware(BodyLimit, limit=deps.max_request_bytes, refuse=too_large, exempt=deps.upload_prefix)

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        """The data plane's routes and bodies (`/openapi.json`) as one self-contained page."""
        return HTMLResponse(api_docs_page(app.openapi()))

    @app.get("/health")
    async def health() -> dict:
        """Liveness: the ingress answers (what the pods' probes ask)."""
        return {"status": "ok"}

    ready: dict[str, Any] = {"at": -1.0}

    @app.get("/ready")
    async def readiness() -> JSONResponse:
        """Whether every dependency answers (asked at most once a second): 503 while one does not; the data plane
        meanwhile serves the adapters it resolved before."""
        if deps.readiness is None:
            return JSONResponse({"status": "ready", "dependencies": {}})
        if deps.clock() - ready["at"] >= 1.0:
            ready["status"], ready["at"] = await run_in_threadpool(deps.readiness), deps.clock()
        up = dict(ready["status"])
        body = {"status": "ready" if all(up.values()) else "not ready",
                "dependencies": {d: "up" if ok else "down" for d, ok in up.items()}}
        return JSONResponse(body, status_code=200 if all(up.values()) else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if deps.metrics_token is not None:
            given = request.headers.get("authorization", "").partition(" ")[2].strip()
            if not hmac.compare_digest(given.encode(), deps.metrics_token.encode()):
                raise APIError(401, "/metrics needs the metrics token.", code="invalid_api_key")
        return Response(m.render(), media_type=CONTENT_TYPE)

    async def authenticated(request: Request) -> str:
        # A dependency, so FastAPI runs it before validating the body: a bad key is 401 first, and a benched
        # tenant or one over its rate is 429 before its body is parsed. Async: no worker-thread hop for an
        # in-process limiter.
        tenant = request.state.tenant = _tenant(deps, request)
        await _unbenched(deps, tenant)
        await _take(deps, "tenant", tenant)
        return tenant

    def visible(records) -> list[tuple[str, Optional[str]]]:
        """(name, owner tenant or None when public) of the adapters on this base, from the resolver's listing."""
        return sorted({(r.name, None if r.visibility == "public" else r.owner_tenant)
                       for r in records if r.base_model == deps.base_name})

    # The resolver's listing is a snapshot that stays the same object until the registry changes, so the rendered
    # body is kept per tenant and re-rendered only after a change: O(1) per request at any number of adapters.
    rendered: dict[str, tuple[Any, bytes]] = {}

    @app.get("/v1/models")
    async def models(tenant: str = Depends(authenticated)) -> Response:
        records = await run_in_threadpool(deps.resolver.list_adapters, tenant)
        cached = rendered.get(tenant)
        if cached is None or cached[0] is not records:
            body = JSONResponse(R.model_list(deps.base_name, visible(records), int(deps.clock()))).body
            cached = rendered[tenant] = (records, body)
        return Response(cached[1], media_type="application/json")

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str, tenant: str = Depends(authenticated)) -> dict:
        """One model as `/v1/models` lists it: the base, or an adapter visible to the tenant."""
        try:
            ref = parse_model(model_id, deps.base_name)
        except ValueError:
            ref = None
        created = int(deps.clock())
        if ref is not None and ref.adapter is None:
            return R.model_object(deps.base_name, deps.base_name, None, created)
        if ref is not None and ref.base in (None, deps.base_name):
            records = await run_in_threadpool(deps.resolver.list_adapters, tenant)
            for r in records:
                if r.name == ref.adapter and r.base_model == deps.base_name:
                    owner = None if r.visibility == "public" else r.owner_tenant
                    return R.model_object(r.name, deps.base_name, owner, created)
        raise APIError(404, f"The model {model_id!r} does not exist or you do not have access to it.",
                       code="model_not_found", param="model")

    async def _run(request: Request, tenant: str, body: Any, chat: bool) -> Response:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        label, shown_tenant = "-", tenant if deps.metrics_token is not None else PRIVATE
        try:
            target = await run_in_threadpool(_resolve, deps, body.model, tenant, rid)
            redact = target.private and deps.metrics_token is None
            label = PRIVATE if redact else target.name
            sampling, explicit = _sampling(body, deps.default_chat_tokens if chat else deps.default_completion_tokens,
                                           deps.max_tokens_limit)
            if target.key is not None:
                await _take(deps, "adapter", target.name)
            common = dict(n=body.n, max_tokens_explicit=explicit, submitted_at=deps.clock(), adapter_record=target.record)
            if chat:
                messages = [{"role": msg.role, "content": msg.text()} for msg in body.messages]
                req = GenerateRequest(rid, target.key, sampling, messages=messages, **common)
            elif len(body.prompt) == 1 and isinstance(body.prompt[0], list):
                req = GenerateRequest(rid, target.key, sampling, prompt_token_ids=body.prompt[0], **common)
            elif len(body.prompt) == 1:
                req = GenerateRequest(rid, target.key, sampling, prompt=body.prompt[0], **common)
            else:
                req = GenerateRequest(rid, target.key, sampling, prompts=list(body.prompt), **common)
            run = StreamRun(deps, req, shown_tenant, label, chat, body.model, logprobs=sampling["logprobs"] is not None,
                            include_usage=bool(body.stream_options and body.stream_options.include_usage),
                            redact=redact, request_id_header="x-request-id" not in request.headers)
            await run.begin()  # errors before the first token still become plain HTTP errors
        except APIError as err:
            m.requests.labels(label, shown_tenant, str(err.status)).inc()
            m.errors.labels(label, shown_tenant, err.code or "error").inc()
            raise
        if body.stream:
            return StreamingResponse(run.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **run.headers()})
        return JSONResponse(await run.collect(), headers=run.headers())

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest, tenant: str = Depends(authenticated)) -> Response:
        return await _run(request, tenant, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest,
                               tenant: str = Depends(authenticated)) -> Response:
        return await _run(request, tenant, body, chat=True)

    if deps.admin_app is not None:
        app.mount(deps.admin_prefix, deps.admin_app)
    return app
