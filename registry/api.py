"""Control-plane REST API (FastAPI). `create_app(registry, tokens)` is mountable in Ray Serve; standalone:
`uvicorn --factory registry.api:create_app` (settings and tokens from the environment).

Request bodies are strict (no bool or string where a number is due, no unknown fields); the OpenAPI schema and
its docs page need the admin token like every other route."""

from typing import Annotated, Literal

from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, TypeAdapter
from starlette.exceptions import HTTPException as StarletteHTTPException

from registry.auth import Principal, TokenAuth, tokens_from_env
from registry.base_model import BaseModelSpec
from registry.errors import AdapterNotFound, PermissionDenied, RegistryError
from registry.records import AdapterRecord, AdapterState, AuditEntry, Visibility
from registry.registry import Registry
from registry.uploads import UploadArea, UploadStatus

__all__ = ["create_app"]


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
    labels: dict[StrictStr, StrictStr] = Field(default_factory=dict)
    description: StrictStr = Field(default="", max_length=4000)
    activate: StrictBool = Field(default=False, description="promote right after validation")


MAX_INT = 2**62  # keeps ids inside SQLite INTEGER and Redis stream-id range
Version = Annotated[StrictInt, Field(ge=1, le=MAX_INT)]


class PromoteRequest(_Body):
    version: Version


class CanaryRequest(_Body):
    version: Version
    weight: float = Field(gt=0.0, lt=1.0, strict=True, description="share of requests served by the canary version")


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
    deleted_blobs: list[str]


class GcResult(BaseModel):
    deleted_blobs: list[str]


class ErrorBody(BaseModel):
    message: str
    type: str
    code: str


class ErrorResponse(BaseModel):
    error: ErrorBody


def _error(status: int, message: str, code: str, headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status_code=status,
                        headers=headers)


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


def create_app(registry: Registry | None = None, tokens: dict[str, dict] | None = None) -> FastAPI:
    registry = registry or Registry.from_settings()
    auth = TokenAuth(tokens_from_env() if tokens is None else tokens)
    Caller = Annotated[Principal, Depends(auth)]
    Name = Annotated[str, Path(description="adapter name")]
    errors = {k: {"model": ErrorResponse} for k in (400, 401, 403, 404, 409, 422)}
    app = FastAPI(title="LoRA adapter registry", version="1", responses=errors, docs_url=None, redoc_url=None,
                  openapi_url=None)
    uploads = UploadArea(registry.settings.upload_dir, registry.settings.max_files, registry.settings.max_file_bytes,
                         registry.settings.upload_ttl_s)

    @app.exception_handler(RegistryError)
    async def _registry_error(request: Request, exc: RegistryError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return _error(exc.status, exc.message, exc.code, headers)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError):
        msg = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return _error(422, msg or "invalid request", "invalid_request")

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

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(p: Caller) -> JSONResponse:
        _require_admin(p)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    def docs(request: Request, p: Caller) -> HTMLResponse:
        # The browser fetches the schema itself, so the page carries the token it was opened with.
        _require_admin(p)
        root = request.scope.get("root_path", "").rstrip("/")
        token = request.headers["authorization"].partition(" ")[2].strip()
        html = get_swagger_ui_html(openapi_url=f"{root}/openapi.json", title=app.title).body.decode()
        inject = ("requestInterceptor: (r) => { r.headers['Authorization'] = 'Bearer ' + "
                  f"{token!r}; return r; }},")
        return HTMLResponse(html.replace("dom_id:", inject + "\n    dom_id:", 1))

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

    @app.post("/v1/gc", response_model=GcResult)
    def collect_garbage(p: Caller):
        _require_admin(p)
        return GcResult(deleted_blobs=registry.collect_garbage())

    @app.put("/v1/uploads/{upload_id}/{filename}", response_model=UploadStatus)
    async def upload_file(upload_id: Annotated[str, Path(pattern=UploadArea.ID_PATTERN)],
                          filename: Annotated[str, Path(pattern=UploadArea.FILE_PATTERN)], request: Request,
                          p: Caller, x_content_sha256: Annotated[str, Header(pattern=r"^[0-9a-f]{64}$")]):
        """Stream one file of an upload (the body is the file's bytes); checked against X-Content-SHA256.
        Idempotent: re-sending a file that is already there with the same hash costs nothing."""
        return await uploads.put(upload_id, filename, x_content_sha256, request.stream())

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
