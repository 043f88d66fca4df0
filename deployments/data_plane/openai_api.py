"""The OpenAI-compatible data plane as a FastAPI app built from injected parts.

`create_openai_app(IngressDeps(...))` has no Ray in it: the Serve ingress passes an `llm`
that calls the replicas through a deployment handle; unit tests pass a fake.
Order of checks per request: API key -> the caller's bench (RefusalHold: a caller refused over and over) -> the
tenant's rate limit, all in the front door (`front_door.FrontDoor`) from the headers alone -> body size -> body ->
the prompt's length against the replicas' bound (`protocol.PromptBound`) -> model name -> registry (visibility,
disabled, canary pick) -> the adapter's rate limit -> cold-load gate -> replica, so a request refused for its body
has cost its tenant a token like any other, and every 4xx answer to a caller counts towards benching it. Every
error answer is an OpenAI error body and is counted by status and reason in `/metrics`; a dependency out of reach
(the registry's Redis or S3) is a 503 with Retry-After. Without `metrics_token`, /metrics names no tenant and no
tenant-private adapter (both labelled "private").
"""

from __future__ import annotations

import asyncio
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
from deployments.data_plane.front_door import FrontDoor, caller_of, take
from deployments.data_plane.protocol import GenerateRequest, PromptBound
from deployments.data_plane.rate_limit import ColdLoadGate, RefusalHold
from deployments.data_plane.stream import StreamRun
from registry.api_docs import api_docs_page
from router.keys import AdapterKey

__all__ = ["create_openai_app", "IngressDeps", "KnownBound", "LLMClient", "Resolver", "Limiter"]

logger = logging.getLogger(__name__)
PRIVATE = "private"  # the adapter label of tenant-private adapters in an open /metrics


class Resolver(Protocol):
    def resolve(self, name: str, tenant: Optional[str], request_id: Optional[str] = None) -> Any: ...
    def list_adapters(self, tenant: Optional[str] = None) -> list: ...


class LLMClient(Protocol):
    def stream(self, req: GenerateRequest) -> AsyncIterator[dict]: ...

    async def prompt_bound(self) -> PromptBound: ...  # the replicas' (each replica has the same)


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
    # the replicas' prompt bound, asked of one in the background; until it answers prompts are checked on the replica
    prompt_bound: "KnownBound" = field(default_factory=lambda: KnownBound())


@dataclass
class KnownBound:
    """The replicas' `PromptBound`, asked of one replica once, in the background: None until one answers."""

    value: Optional[PromptBound] = None
    retry_s: float = 1.0  # the first wait after a failed ask; doubled up to 30 s
    _task: Optional[asyncio.Task] = None

    def get(self, llm: LLMClient) -> Optional[PromptBound]:
        """The bound if known; the first call starts asking `llm` for it (on the running loop)."""
        if self.value is None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._ask(llm))
        return self.value

    async def _ask(self, llm: LLMClient) -> None:
        wait = self.retry_s
        while self.value is None:
            try:
                self.value = await llm.prompt_bound()
            except Exception as e:  # noqa: BLE001 - no replica yet, or one that failed: ask again later
                logger.info("asking a replica for its prompt bound failed (%s); again in %.0fs", e, wait)
                await asyncio.sleep(wait)
                wait = min(30.0, 2 * wait)


@dataclass(frozen=True)
class _Model:
    key: Optional[str]  # adapter key (name@version); None: the base model
    name: str  # adapter name, "-" for the base
    private: bool
    record: Any = None  # the registry's record of the version (the replica loads its files from it)


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


def _inputs(body: Any, chat: bool) -> dict[str, Any]:
    """The prompt fields of the GenerateRequest of a parsed body."""
    if chat:
        return {"messages": [{"role": msg.role, "content": msg.text()} for msg in body.messages]}
    if len(body.prompt) == 1 and isinstance(body.prompt[0], list):
        return {"prompt_token_ids": body.prompt[0]}
    if len(body.prompt) == 1:
        return {"prompt": body.prompt[0]}
    return {"prompts": list(body.prompt)}


def _check_length(bound: Optional[PromptBound], inputs: dict[str, Any], chat: bool) -> None:
    """A 400 for a prompt whose length alone shows it cannot fit the replicas' context (no tokenizer here)."""
    why = None if bound is None else bound.refusal_of(**inputs)
    if why is not None:
        raise APIError(400, why, code="context_length_exceeded", param="messages" if chat else "prompt")


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
        # a 4xx answer to a caller the front door let in counts towards benching it (RefusalHold)
        caller = caller_of(request.scope)
        if caller is not None and 400 <= err.status < 500:
            deps.hold.refused(str(caller))
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
    # added last, so it runs first: the caller is known, benched or charged before the body limit reads a byte
    app.add_middleware(FrontDoor, api_keys=deps.api_keys, limiter=deps.limiter, hold=deps.hold, answer=answer,
                       count_limited=lambda scope: m.rate_limited.labels(scope).inc(),
                       count_held=m.refusals_held.inc)

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

    def authenticated(request: Request) -> str:
        """The tenant the front door let in."""
        return caller_of(request.scope).tenant

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
            inputs = _inputs(body, chat)
            _check_length(deps.prompt_bound.get(deps.llm), inputs, chat)
            target = await run_in_threadpool(_resolve, deps, body.model, tenant, rid)
            redact = target.private and deps.metrics_token is None
            label = PRIVATE if redact else target.name
            sampling, explicit = _sampling(body, deps.default_chat_tokens if chat else deps.default_completion_tokens,
                                           deps.max_tokens_limit)
            if target.key is not None:
                await take(deps.limiter, "adapter", target.name, lambda scope: m.rate_limited.labels(scope).inc())
            req = GenerateRequest(rid, target.key, sampling, n=body.n, max_tokens_explicit=explicit,
                                  submitted_at=deps.clock(), adapter_record=target.record, **inputs)
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
