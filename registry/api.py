"""Control-plane REST API (FastAPI). `create_app(registry, tokens)` is mountable in Ray Serve; standalone:
`uvicorn --factory registry.api:create_app` (settings and tokens from the environment).

Request bodies are strict (no bool or string where a number is due, no unknown fields); the OpenAPI schema and
its docs page need the admin token like every other route (a browser gives it as the password of HTTP Basic
auth). Every refused mutation is in the audit log as `{action}_rejected` (who, why), those refused for their
body's shape too; a store out of reach is a 503 with Retry-After."""

import logging
from typing import Annotated, Callable, Literal

from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, TypeAdapter
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from registry.api_docs import api_docs_page
from registry.auth import Principal, TokenAuth, tokens_from_env
from registry.base_model import BaseModelSpec
from registry.canary_analysis import judge, not_compared, window, window_closed
from registry.canary_policy import MAX_GOLDEN, GoldenPrompt, RolloutPolicy
from registry.errors import (AdapterNotFound, PermissionDenied, RegistryError, RegistryUnavailable,
                             RegistryValidationError)
from registry.records import AdapterRecord, AdapterState, AuditEntry, Visibility
from registry.registry import Registry
from registry.rollout_state import Rollout
from registry.uploads import UploadArea, UploadAreaUsage, UploadStatus

__all__ = ["create_app"]

logger = logging.getLogger(__name__)


_AUDIT_LIST = TypeAdapter(list[AuditEntry])


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterRequest(_Body):
    name: StrictStr = Field(description="adapter name; 1-64 of [A-Za-z0-9_.-]")
    source_uri: StrictStr = Field(description="s3://bucket/prefix/dir under an allowed prefix, an absolute local "
                                              "directory under an allowed root, or an upload's source_uri")
    sha256: dict[StrictStr, StrictStr] = Field(description="file name -> hex sha256, one per file in the source")
    base_model: StrictStr
    tenant: StrictStr | None = Field(default=None, description="owner tenant (publishers: their own, implied)")
    visibility: Visibility = Visibility.public
    labels: dict[StrictStr, StrictStr] = Field(default_factory=dict, description="at most 32; keys 1-64 "
                                               "characters, values at most 256")
    description: StrictStr = Field(default="", description="at most 4000 characters")
    activate: StrictBool = Field(default=False, description="promote right after validation")


MAX_INT = 2**62  # keeps ids inside SQLite INTEGER and Redis stream-id range
Version = Annotated[StrictInt, Field(ge=1, le=MAX_INT)]


class PromoteRequest(_Body):
    version: Version


class CanaryRequest(_Body):
    version: Version
    weight: float = Field(gt=0.0, lt=1.0, strict=True, description="share of requests served by the canary version")


class GoldenRequest(_Body):
    prompts: list[GoldenPrompt] = Field(max_length=MAX_GOLDEN, description="replace the version's golden prompts "
                                        "([] removes them)")


class RolloutRequest(_Body):
    version: Version
    policy: RolloutPolicy = Field(default_factory=RolloutPolicy, description="steps, window and thresholds; each "
                                  "field not given takes its default")


class RolloutWindow(BaseModel):
    """The running step's window so far, from the replicas' latest reports."""

    step: int
    weight: float
    elapsed_s: float
    closed: bool = Field(description="the window has its requests and its seconds: it is judged at the next tick")
    canary: dict
    stable: dict
    checks: list[dict] = Field(description="the thresholds applied to the window as it is now")
    not_compared: dict[str, str] = Field(default_factory=dict, description="check -> why the window has no data "
                                         "for it yet")


class RolloutStatus(BaseModel):
    name: str
    active_version: int | None
    canary_version: int | None
    canary_weight: float
    rollout: Rollout | None
    window: RolloutWindow | None = Field(None, description="null unless a step is running and the replicas' "
                                         "reports are known here")


class BaseModelRequest(_Body):
    name: StrictStr
    config: dict = Field(description="the model's config.json contents")
    aliases: list[StrictStr] = Field(default_factory=list)


class AdapterSummary(BaseModel):
    name: str
    owner_tenant: str | None
    active_version: int | None
    canary_version: int | None
    canary_weight: float
    disabled: bool
    latest_version: int | None = Field(description="highest version number issued")
    active: AdapterRecord | None


class AdapterPage(BaseModel):
    items: list[AdapterSummary]
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null at the end")


class DeleteResult(BaseModel):
    name: str
    deleted_versions: list[int]
    deleted_blobs: list[str] = Field(description="sha256 of the blobs freed: those no other version uses")
    dropped_copies: list[str] = Field(default_factory=list, description=(
        "the control plane host's materialized copies removed (each replica removes its own on the change feed)"))


class GcResult(BaseModel):
    deleted_blobs: list[str]


class ErrorBody(BaseModel):
    """OpenAI's error object, as the data plane answers it too."""

    message: str
    type: str
    param: str | None = None
    code: str


class ErrorResponse(BaseModel):
    error: ErrorBody


_MUTATIONS = frozenset({"POST", "PUT", "DELETE", "PATCH"})


# status -> OpenAI's error type, the data plane's vocabulary (deployments/data_plane/errors.py)
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def _error(status: int, message: str, code: str, headers: dict | None = None) -> JSONResponse:
    kind = "server_error" if status >= 500 else _ERROR_TYPES.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status, headers=headers)


def _summary(state: AdapterState) -> AdapterSummary:
    return AdapterSummary(name=state.name, owner_tenant=state.owner_tenant, active_version=state.active_version,
                          canary_version=state.canary_version, canary_weight=state.canary_weight,
                          disabled=state.disabled, latest_version=max(state.last_version, max(state.versions, default=0)) or None,
                          active=state.versions.get(state.active_version) if state.active_version else None)


def _can_see(p: Principal, state: AdapterState) -> bool:
    if p.role == "admin" or state.owner_tenant == p.tenant:
        return True
    active = state.versions.get(state.active_version) if state.active_version else None
    return active is not None and active.visible_to(p.tenant)


def _require_admin(p: Principal) -> None:
    if p.role != "admin":
        raise PermissionDenied(f"{p.name} (role {p.role}) may not do this; admin only")


def create_app(registry: Registry | None = None, tokens: dict[str, dict] | None = None,
               golden: Callable[[AdapterRecord, list], list[dict]] | None = None,
               replica_reports: Callable[[], dict] | None = None) -> FastAPI:
    """`golden(record, prompts)`: runs golden prompts on a version (the served app's data plane; None: a control
    plane alone, which refuses rollouts of versions that have golden prompts). `replica_reports()`: replica id ->
    its latest report, for the live window of `GET .../rollout` (None: not shown)."""
    registry = registry or Registry.from_settings()
    auth = TokenAuth(tokens_from_env() if tokens is None else tokens)
    Caller = Annotated[Principal, Depends(auth)]
    Name = Annotated[str, Path(description="adapter name")]
    errors = {k: {"model": ErrorResponse} for k in (400, 401, 403, 404, 409, 413, 422, 503, 507)}
    app = FastAPI(title="LoRA adapter registry", version="1", responses=errors, docs_url=None, redoc_url=None,
                  openapi_url=None)
    uploads = registry.uploads

    def audit_refusal(request: Request, err: RegistryError, body: object = None) -> None:
        """A refused mutation of an authenticated caller into the audit log, named after its route."""
        route = request.scope.get("route")
        if request.method not in _MUTATIONS or route is None or err.status == 401:
            return
        try:
            who = auth(request)
        except RegistryError:
            return
        fields = body if isinstance(body, dict) else {}
        name = request.path_params.get("name") or request.path_params.get("upload_id") or fields.get("name")
        name = name if isinstance(name, str) and name else "-"
        registry.audit_refusal(who.name, route.name, name, err)

    @app.exception_handler(RegistryError)
    async def _registry_error(request: Request, exc: RegistryError):
        await run_in_threadpool(audit_refusal, request, exc)
        headers = {"WWW-Authenticate": getattr(exc, "challenge", "Bearer")} if exc.status == 401 else None
        if isinstance(exc, RegistryUnavailable):
            headers = {"Retry-After": str(exc.retry_after_s)}
        return _error(exc.status, exc.message, exc.code, headers)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError):
        msg = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        err = RegistryValidationError(msg or "invalid request", code="invalid_request")
        err.status = 422
        await run_in_threadpool(audit_refusal, request, err, exc.body)
        return _error(422, err.message, err.code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("control plane: unhandled error")
        return _error(500, f"internal error: {type(exc).__name__}", "internal_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), "http_error")

    def owned_state(p: Principal, name: str) -> AdapterState:
        """The adapter a mutation targets; publishers only act on their tenant's adapters."""
        state = registry.get(name)
        if p.role == "admin" or state.owner_tenant == p.tenant:
            return state
        if _can_see(p, state):
            raise PermissionDenied(f"adapter {name!r} belongs to another tenant")
        raise AdapterNotFound(f"adapter {name!r} not found")

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", "revision": registry.revision()}

    BrowserCaller = Annotated[Principal, Depends(auth.browser)]

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(p: BrowserCaller) -> JSONResponse:
        _require_admin(p)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    def docs(p: BrowserCaller) -> HTMLResponse:
        """The routes and their bodies, from the OpenAPI schema, as one self-contained page (no script, nothing
        fetched from elsewhere)."""
        _require_admin(p)
        return HTMLResponse(api_docs_page(app.openapi()))

    @app.post("/v1/adapters", status_code=201, response_model=AdapterRecord)
    def register(body: RegisterRequest, p: Caller):
        tenant = body.tenant
        if p.role == "admin" and tenant is None:
            # an admin adding a version to an existing adapter acts on behalf of its owner
            existing = registry.metadata.get_serving_state(body.name)
            tenant = existing.owner_tenant if existing else None
        if p.role == "publisher":
            if tenant not in (None, p.tenant):
                raise PermissionDenied(f"publisher of tenant {p.tenant!r} cannot register for tenant {tenant!r}")
            tenant = p.tenant
        return registry.register(body.name, body.source_uri, body.sha256, body.base_model, tenant=tenant,
                                 visibility=body.visibility, actor=p.name, labels=body.labels,
                                 description=body.description, activate=body.activate)

    @app.get("/v1/adapters", response_model=AdapterPage)
    def list_adapters(p: Caller, cursor: Annotated[str | None, Query(max_length=64)] = None,
                      limit: Annotated[int, Query(ge=1, le=1000)] = 100):
        page = registry.list_page(cursor, limit)
        items = [_summary(s) for s in page if _can_see(p, s)]
        # Serialized here, not re-validated against response_model by FastAPI: that doubled a page's time.
        return Response(AdapterPage(items=items, next_cursor=page[-1].name if len(page) == limit else None)
                        .model_dump_json(), media_type="application/json")

    @app.get("/v1/adapters/{name}", response_model=AdapterState)
    def show(name: Name, p: Caller):
        state = registry.get(name)
        if not _can_see(p, state):
            raise AdapterNotFound(f"adapter {name!r} not found")
        return state

    @app.get("/v1/adapters/{name}/versions", response_model=list[AdapterRecord])
    def versions(name: Name, p: Caller):
        return [r for _, r in sorted(show(name, p).versions.items())]

    @app.post("/v1/adapters/{name}/promote", response_model=AdapterState)
    def promote(name: Name, body: PromoteRequest, p: Caller):
        owned_state(p, name)
        return registry.promote(name, body.version, actor=p.name)

    @app.post("/v1/adapters/{name}/canary", response_model=AdapterState)
    def canary(name: Name, body: CanaryRequest, p: Caller):
        owned_state(p, name)
        return registry.canary(name, body.version, body.weight, actor=p.name)

    @app.post("/v1/adapters/{name}/rollback", response_model=AdapterState)
    def rollback(name: Name, p: Caller):
        owned_state(p, name)
        return registry.rollback(name, actor=p.name)

    @app.post("/v1/adapters/{name}/disable", response_model=AdapterState)
    def disable(name: Name, p: Caller):
        owned_state(p, name)
        return registry.disable(name, actor=p.name)

    @app.post("/v1/adapters/{name}/enable", response_model=AdapterState)
    def enable(name: Name, p: Caller):
        owned_state(p, name)
        return registry.enable(name, actor=p.name)

    @app.post("/v1/adapters/{name}/versions/{version}/retire", response_model=AdapterState)
    def retire(name: Name, version: Annotated[int, Path(ge=1, le=MAX_INT)], p: Caller):
        owned_state(p, name)
        return registry.retire(name, version, actor=p.name)

    @app.delete("/v1/adapters/{name}/versions/{version}", response_model=DeleteResult)
    def delete_version(name: Name, version: Annotated[int, Path(ge=1, le=MAX_INT)], p: Caller,
                       force: Annotated[bool, Query(description="also the active version")] = False):
        owned_state(p, name)
        return registry.delete_version(name, version, force=force, actor=p.name)

    @app.delete("/v1/adapters/{name}", response_model=DeleteResult)
    def delete_adapter(name: Name, p: Caller,
                       force: Annotated[bool, Query(description="even with an active version")] = False):
        owned_state(p, name)
        return registry.delete_adapter(name, force=force, actor=p.name)

    def rollout_status(state: AdapterState) -> RolloutStatus:
        r, live = state.rollout, None
        reports = replica_reports() if replica_reports is not None and r is not None and r.phase == "running" else None
        if reports is not None:
            c = window(reports, r.baseline, f"{state.name}@{r.version}")
            s = window(reports, r.baseline, f"{state.name}@{r.stable_version}")
            elapsed = max(0.0, registry._clock() - (r.step_started_at or 0.0))
            checks = judge(r.policy.thresholds, c, s)
            live = RolloutWindow(step=r.step, weight=r.weight, elapsed_s=elapsed,
                                 closed=window_closed(r.policy, c, s, elapsed), canary=c.summary(), stable=s.summary(),
                                 checks=[ch.model_dump() for ch in checks],
                                 not_compared=not_compared(r.policy.thresholds, c, s, checks))
        return RolloutStatus(name=state.name, active_version=state.active_version,
                             canary_version=state.canary_version, canary_weight=state.canary_weight, rollout=r,
                             window=live)

    @app.put("/v1/adapters/{name}/versions/{version}/golden", response_model=AdapterRecord)
    def set_golden(name: Name, version: Annotated[int, Path(ge=1, le=MAX_INT)], body: GoldenRequest, p: Caller):
        """The version's golden prompts: a rollout to it runs them on the stable version first (they must pass
        there), on the canary before its first step and at every step; a failure rolls it back."""
        owned_state(p, name)
        return registry.set_golden(name, version, body.prompts, actor=p.name).versions[version]

    @app.post("/v1/adapters/{name}/rollout", status_code=201, response_model=RolloutStatus)
    def rollout_start(name: Name, body: RolloutRequest, p: Caller):
        """Roll `version` out automatically: golden prompts, then each traffic step's window judged against the
        active version, then promotion; a failed check rolls it back. 409 while another rollout or a canary runs."""
        owned_state(p, name)
        return rollout_status(registry.start_rollout(name, body.version, body.policy, actor=p.name,
                                                     check_golden=golden))

    @app.get("/v1/adapters/{name}/rollout", response_model=RolloutStatus)
    def get_rollout(name: Name, p: Caller):
        """The latest rollout: its steps with the numbers that decided each, and the running step's window."""
        return rollout_status(show(name, p))

    @app.post("/v1/adapters/{name}/rollout/abort", response_model=RolloutStatus)
    def rollout_abort(name: Name, p: Caller):
        owned_state(p, name)
        return rollout_status(registry.abort_rollout(name, actor=p.name))

    @app.post("/v1/gc", response_model=GcResult)
    def collect_garbage(p: Caller):
        _require_admin(p)
        return GcResult(deleted_blobs=registry.collect_garbage())

    @app.put("/v1/uploads/{upload_id}/{filename}", response_model=UploadStatus, name="upload")
    async def upload_file(upload_id: Annotated[str, Path(pattern=UploadArea.ID_PATTERN)],
                          filename: Annotated[str, Path(pattern=UploadArea.FILE_PATTERN)], request: Request,
                          p: Caller, x_content_sha256: Annotated[str, Header(pattern=r"^[0-9a-f]{64}$")],
                          x_upload_offset: Annotated[int, Header(ge=0, le=MAX_INT)] = 0,
                          content_length: Annotated[int | None, Header(ge=0)] = None):
        """Stream one file of an upload (the body is the file's bytes, from byte X-Upload-Offset on when it
        resumes one cut off: the status's `partial`), streamed to disk and checked against X-Content-SHA256; over
        the upload limit (RegistrySettings.max_file_bytes) a 413. Idempotent: re-sending a file that is already
        there with the same hash costs nothing."""
        try:
            return await uploads.put(upload_id, filename, x_content_sha256, request.stream(), x_upload_offset,
                                     content_length)
        except ClientDisconnect:  # the part received so far stays, to resume; nobody reads this answer
            return Response(status_code=400)

    @app.get("/v1/uploads", response_model=UploadAreaUsage)
    def upload_area(p: Caller):
        """The upload area: bytes held against its bound, and each session with its size and when it ends."""
        _require_admin(p)
        return uploads.usage()

    @app.get("/v1/uploads/{upload_id}", response_model=UploadStatus)
    def upload_status(upload_id: Annotated[str, Path(pattern=UploadArea.ID_PATTERN)], p: Caller):
        return uploads.status(upload_id)

    @app.post("/v1/base-models", status_code=201, response_model=BaseModelSpec)
    def register_base_model(body: BaseModelRequest, p: Caller):
        _require_admin(p)
        return registry.register_base_model(body.name, body.config, actor=p.name, aliases=body.aliases)

    @app.get("/v1/base-models", response_model=list[BaseModelSpec])
    def list_base_models(p: Caller):
        return registry.list_base_models()

    @app.get("/v1/audit", response_model=list[AuditEntry])
    def audit(p: Caller, name: Annotated[str | None, Query(max_length=200)] = None,
              after_seq: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
              before_seq: Annotated[int | None, Query(ge=1, le=MAX_INT)] = None,
              limit: Annotated[int, Query(ge=1, le=1000)] = 100,
              order: Literal["newest", "oldest"] = "newest"):
        _require_admin(p)
        entries = registry.audit(name, after_seq, limit, before_seq=before_seq, newest_first=order == "newest")
        return Response(_AUDIT_LIST.dump_json(entries), media_type="application/json")

    return app
