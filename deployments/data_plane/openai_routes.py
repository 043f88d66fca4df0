"""The OpenAI routes as one class on an `APIRouter`: `/v1/models`, `/v1/models/{id}`, `/v1/completions`,
`/v1/chat/completions`, and the service routes `/health`, `/ready`, `/metrics`, `/docs`.

By the time a `/v1/` handler runs, the front door (`front_door.FrontDoor`) has let its caller in: the handler reads
the caller from the request's scope. A completion goes: body (parsed by FastAPI) -> the prompt's length against
the replicas' bound -> model name -> registry (visibility, disabled, canary pick) -> the adapter's rate limit ->
`ReplicaSession` (cold-load gate, replica) -> a renderer (JSON or SSE).
"""

from __future__ import annotations

import hmac
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from deployments.data_plane import responses as R
from deployments.data_plane.errors import APIError, retry_after
from deployments.data_plane.front_door import take, tenant_let_in
from deployments.data_plane.ingress_deps import IngressDeps
from deployments.data_plane.openai_schema import ChatCompletionRequest, CompletionRequest, parse_model
from deployments.data_plane.protocol import GenerateRequest, PromptBound
from deployments.data_plane.renderers import Shape, render_json, render_sse, response_headers
from deployments.data_plane.replica_session import ReplicaSession, Retries
from deployments.data_plane.stream_metrics import StreamMetrics
from deployments.dependency_health import DependencyUnavailable
from deployments.metrics import CONTENT_TYPE
from registry.api_docs import api_docs_page
from router.keys import AdapterKey

__all__ = ["OpenAIRoutes", "context_length_error", "unavailable", "prompt_inputs", "PRIVATE"]

PRIVATE = "private"  # the adapter label of tenant-private adapters in an open /metrics


@dataclass(frozen=True)
class _Model:
    key: Optional[str]  # adapter key (name@version); None: the base model
    name: str  # adapter name, "-" for the base
    private: bool
    record: Any = None  # the registry's record of the version (the replica loads its files from it)


def unavailable(err: DependencyUnavailable) -> APIError:
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
        raise unavailable(e) from None
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


def prompt_inputs(body: Any, chat: bool) -> dict[str, Any]:
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
        raise context_length_error(why, chat)


def context_length_error(why: str, chat: bool) -> APIError:
    """The 400 for a prompt that cannot fit, `why` from `PromptBound`, named as OpenAI names the field."""
    return APIError(400, why, code="context_length_exceeded", param="messages" if chat else "prompt")


class OpenAIRoutes:
    """The data plane's handlers over `deps`; `router` holds them."""

    def __init__(self, deps: IngressDeps):
        self.deps = deps
        self._ready: dict[str, Any] = {"at": -1.0}  # the last readiness answer, asked at most once a second
        # The resolver's listing is a snapshot that stays the same object until the registry changes, so the body
        # is kept per tenant and rendered again only after a change: O(1) per request at any number of adapters.
        self._listed: dict[str, tuple[Any, bytes]] = {}
        r = self.router = APIRouter()
        r.add_api_route("/docs", self.docs, methods=["GET"], include_in_schema=False)
        r.add_api_route("/health", self.health, methods=["GET"])
        r.add_api_route("/ready", self.ready, methods=["GET"])
        r.add_api_route("/metrics", self.metrics, methods=["GET"])
        r.add_api_route("/v1/models", self.models, methods=["GET"])
        r.add_api_route("/v1/models/{model_id}", self.model, methods=["GET"])
        r.add_api_route("/v1/completions", self.completions, methods=["POST"])
        r.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])

    # ------------------------------------------------------------------ service routes
    async def docs(self, request: Request) -> HTMLResponse:
        """The data plane's routes and bodies (`/openapi.json`) as one self-contained page."""
        return HTMLResponse(api_docs_page(request.app.openapi()))

    async def health(self) -> dict:
        """Liveness: the ingress answers (what the pods' probes ask)."""
        return {"status": "ok"}

    async def ready(self) -> JSONResponse:
        """Whether every dependency answers (asked at most once a second): 503 while one does not; the data plane
        meanwhile serves the adapters it resolved before."""
        deps = self.deps
        if deps.readiness is None:
            return JSONResponse({"status": "ready", "dependencies": {}})
        if deps.clock() - self._ready["at"] >= 1.0:
            self._ready["status"], self._ready["at"] = await run_in_threadpool(deps.readiness), deps.clock()
        up = dict(self._ready["status"])
        body = {"status": "ready" if all(up.values()) else "not ready",
                "dependencies": {d: "up" if ok else "down" for d, ok in up.items()}}
        return JSONResponse(body, status_code=200 if all(up.values()) else 503)

    async def metrics(self, request: Request) -> Response:
        token = self.deps.metrics_token
        if token is not None:
            given = request.headers.get("authorization", "").partition(" ")[2].strip()
            if not hmac.compare_digest(given.encode(), token.encode()):
                raise APIError(401, "/metrics needs the metrics token.", code="invalid_api_key")
        return Response(self.deps.metrics.render(), media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------ models
    def _visible(self, records) -> list[tuple[str, Optional[str]]]:
        """(name, owner tenant or None when public) of the adapters on this base, from the resolver's listing."""
        return sorted({(r.name, None if r.visibility == "public" else r.owner_tenant)
                       for r in records if r.base_model == self.deps.base_name})

    async def models(self, request: Request) -> Response:
        tenant = tenant_let_in(request.scope)
        records = await run_in_threadpool(self.deps.resolver.list_adapters, tenant)
        cached = self._listed.get(tenant)
        if cached is None or cached[0] is not records:
            listing = R.model_list(self.deps.base_name, self._visible(records), int(self.deps.clock()))
            cached = self._listed[tenant] = (records, JSONResponse(listing).body)
        return Response(cached[1], media_type="application/json")

    async def model(self, model_id: str, request: Request) -> dict:
        """One model as `/v1/models` lists it: the base, or an adapter visible to the tenant."""
        deps, tenant = self.deps, tenant_let_in(request.scope)
        try:
            ref = parse_model(model_id, deps.base_name)
        except ValueError:
            ref = None
        created = int(deps.clock())
        if ref is not None and ref.adapter is None:
            return R.model_object(deps.base_name, deps.base_name, None, created)
        if ref is not None and ref.base in (None, deps.base_name):
            for r in await run_in_threadpool(deps.resolver.list_adapters, tenant):
                if r.name == ref.adapter and r.base_model == deps.base_name:
                    owner = None if r.visibility == "public" else r.owner_tenant
                    return R.model_object(r.name, deps.base_name, owner, created)
        raise APIError(404, f"The model {model_id!r} does not exist or you do not have access to it.",
                       code="model_not_found", param="model")

    # ------------------------------------------------------------------ completions
    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        return await self._complete(request, body, chat=False)

    async def chat_completions(self, request: Request, body: ChatCompletionRequest) -> Response:
        return await self._complete(request, body, chat=True)

    async def _complete(self, request: Request, body: Any, chat: bool) -> Response:
        deps, m = self.deps, self.deps.metrics
        tenant = tenant_let_in(request.scope)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        label, shown_tenant = "-", tenant if deps.metrics_token is not None else PRIVATE
        try:
            inputs = prompt_inputs(body, chat)
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
            observer = StreamMetrics(m, label, shown_tenant, deps.clock, redact=redact)
            session = ReplicaSession(deps.llm, deps.gate, req, observer, Retries(deps.retries, deps.retry_backoff_s),
                                     want_logprobs=sampling["logprobs"] is not None)
            await session.begin()  # errors before the first token still become plain HTTP errors
        except APIError as err:
            m.requests.labels(label, shown_tenant, str(err.status)).inc()
            m.errors.labels(label, shown_tenant, err.code or "error").inc()
            raise
        shape = Shape(chat, body.model, logprobs=sampling["logprobs"] is not None,
                      include_usage=bool(body.stream_options and body.stream_options.include_usage))
        own_id = "x-request-id" not in request.headers
        if body.stream:  # the headers go before the first token: a retry after it is told in the stream
            return StreamingResponse(render_sse(session, shape, int(deps.clock())), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              **response_headers(session, own_id)})
        answer = await render_json(session, shape)
        return JSONResponse(answer, headers=response_headers(session, own_id))  # after the retries it took
